import random

import pytest
from transformers import AutoTokenizer

from gspo_megatron.data.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    build_demo_tokenizer,
    load_tokenizer,
    padded_vocab_size,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_demo_tokenizer(d)
    return d


def test_saved_files_load_with_autotokenizer(tok_dir):
    assert (tok_dir / "tokenizer.json").is_file() and (tok_dir / "tokenizer_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(tok) == 259
    assert tok.pad_token == PAD_TOKEN and tok.pad_token_id == 256
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id == 258


def test_ids_are_utf8_bytes_and_roundtrip_exactly(tok_dir):
    tok = load_tokenizer(tok_dir)
    rng = random.Random(0)
    samples = ["", " leading and trailing ", "a\n\tb\r\n", "\x00\x7f", "héllo wörld", "日本語 🌍👍🏽", "  x  y  "]
    # random code points across planes (surrogates excluded: not encodable in UTF-8)
    for _ in range(50):
        cps = [
            rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])
            for _ in range(rng.randint(1, 20))
        ]
        samples.append("".join(map(chr, cps)))
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False)
        assert ids == list(s.encode("utf-8")), s
        assert tok.decode(ids) == s


def test_chat_template_and_special_tokens(tok_dir):
    tok = load_tokenizer(tok_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 257 and ids.count(258) == 1
    assert tok.decode(ids) == text
    assert tok.decode([ord("7"), tok.eos_token_id], skip_special_tokens=True) == "7"


def test_padded_vocab_size():
    assert padded_vocab_size(259, 64) == 320
    assert padded_vocab_size(256, 64) == 256
    assert padded_vocab_size(1, 128) == 128
    with pytest.raises(ValueError, match="multiple"):
        padded_vocab_size(10, 0)
