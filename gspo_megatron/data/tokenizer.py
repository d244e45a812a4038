"""The demo tokenizer: byte-level, built locally with the `tokenizers` library (nothing from a hub).

Ids 0..255 are the 256 bytes (so every UTF-8 string encodes and decodes back exactly), followed by a
few special tokens. The chat template is ChatML-like::

    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n

and ``<|im_end|>`` is the end-of-sequence token, so a well-formed response ends with it.
The model's embedding table may be larger than ``len(tokenizer)`` (see :func:`padded_vocab_size`).
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)  # ids 256, 257, 258

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_tokenizer() -> Tokenizer:
    """A BPE model with the 256 byte symbols and no merges: one token per byte."""
    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes, in GPT-2's mapping
    byte_to_char = {b: c for b, c in zip(range(256), _gpt2_bytes_to_unicode())}
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}  # id == byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting; add_prefix_space=False keeps the round trip exact.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _gpt2_bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (the one ByteLevel uses), indexed by byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


def build_demo_tokenizer(out_dir: str | os.PathLike | None = None) -> PreTrainedTokenizerFast:
    """Build the byte-level demo tokenizer; when ``out_dir`` is given, save it there
    (tokenizer.json + tokenizer_config.json + chat template) so that
    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads it."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_tokenizer(),
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        fast.save_pretrained(str(out_dir))
    return fast


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load a tokenizer directory (the demo one or any HF tokenizer) with transformers."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    return AutoTokenizer.from_pretrained(str(path))


def padded_vocab_size(vocab_size: int, multiple: int = 64) -> int:
    """Round ``vocab_size`` up to a multiple (so a vocab-parallel output layer splits evenly)."""
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    return -(-vocab_size // multiple) * multiple
