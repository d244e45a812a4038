import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gspo_megatron.data.dataset import DatasetError, PromptDataset, PromptSampler, decode_response
from gspo_megatron.data.tasks import get_task
from gspo_megatron.data.tokenizer import build_demo_tokenizer
from gspo_megatron.engines.base import RolloutSample


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer()


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = json.dumps({"prompt": "2+2?", "label": "4"})


def test_jsonl_rows_are_templated_and_tokenized(tmp_path, tok):
    f = write_lines(tmp_path / "d.jsonl", [GOOD, "", json.dumps({"q": "héllo", "a": [1, 2]})])
    with pytest.raises(DatasetError, match=r"d.jsonl line 3: missing key 'prompt'"):
        PromptDataset.from_file(f, tok)
    ds = PromptDataset.from_file(
        write_lines(tmp_path / "e.jsonl", [json.dumps({"q": "héllo", "a": [1, 2]})]), tok, prompt_key="q", label_key="a"
    )
    row = ds[0]
    assert row.text == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert row.prompt_ids == tok.encode(row.text, add_special_tokens=False)
    assert row.label == [1, 2] and row.source.endswith("e.jsonl line 1")
    raw = PromptDataset.from_file(f, tok, use_chat_template=False, skip_bad_rows=True)
    assert raw[0].text == "2+2?" and raw[0].prompt_ids == list(b"2+2?")


@pytest.mark.parametrize(
    "bad_line,message",
    [
        ("{not json", r"line 2: invalid JSON"),
        (json.dumps([1, 2]), r"line 2: expected a JSON object"),
        (json.dumps({"label": "4"}), r"line 2: missing key 'prompt'"),
        (json.dumps({"prompt": "x"}), r"line 2: missing key 'label'"),
        (json.dumps({"prompt": "   ", "label": "4"}), r"line 2: 'prompt' is empty"),
        (json.dumps({"prompt": 5, "label": "4"}), r"line 2: 'prompt' must be a string, got int"),
        # 100 bytes + 19 tokens of chat template
        (
            json.dumps({"prompt": "x" * 100, "label": "4"}),
            r"line 2: prompt has 119 tokens with the chat template, more than data.max_prompt_len=64",
        ),
    ],
)
def test_bad_rows_name_file_and_line_or_are_skipped(tmp_path, tok, bad_line, message):
    f = write_lines(tmp_path / "bad.jsonl", [GOOD, bad_line, GOOD])
    with pytest.raises(DatasetError, match=r"bad\.jsonl " + message):
        PromptDataset.from_file(f, tok, max_prompt_tokens=64)
    ds = PromptDataset.from_file(f, tok, max_prompt_tokens=64, skip_bad_rows=True)
    assert len(ds) == 2 and ds.skipped_rows == 1
    assert [r.source.rsplit(" ", 1)[-1] for r in ds] == ["1", "3"]


def test_all_rows_bad_is_an_error_even_when_skipping(tmp_path, tok):
    f = write_lines(tmp_path / "x.jsonl", ["{}"])
    with pytest.raises(DatasetError, match="no usable rows"):
        PromptDataset.from_file(f, tok, skip_bad_rows=True)


def test_parquet_and_missing_file(tmp_path, tok):
    table = pa.table({"question": ["a?", "", "c?"], "answer": ["1", "2", "3"]})
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d\.parquet row 2: 'question' is empty"):
        PromptDataset.from_file(tmp_path / "d.parquet", tok, prompt_key="question", label_key="answer")
    ds = PromptDataset.from_file(
        tmp_path / "d.parquet", tok, prompt_key="question", label_key="answer", skip_bad_rows=True
    )
    assert [r.label for r in ds] == ["1", "3"] and ds.skipped_rows == 1
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptDataset.from_file(tmp_path / "nope.jsonl", tok)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DatasetError, match="unsupported dataset format"):
        PromptDataset.from_file(tmp_path / "d.csv", tok)


def test_from_task_records(tok):
    rows = get_task("last_digit").rows(5, seed=0)
    ds = PromptDataset.from_records(rows, tok, source="task last_digit")
    assert [r.prompt for r in ds] == [r["prompt"] for r in rows]
    assert ds[4].source == "task last_digit row 5"


def test_decode_response_drops_only_the_final_stop_token(tok):
    eos, pad = tok.eos_token_id, tok.pad_token_id
    stop = RolloutSample([1], [ord("7"), eos], [0.0, 0.0], "stop")
    assert decode_response(tok, stop) == "7"
    length = RolloutSample([1], [ord("7"), pad, eos], [0.0] * 3, "length")
    assert decode_response(tok, length) == "7<|pad|><|im_end|>"


def test_sampler_is_a_permutation_per_epoch_and_deterministic():
    s = PromptSampler(10, seed=3)
    first = s.next_indices(10)
    second = s.next_indices(10)
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    again = PromptSampler(10, seed=3)
    assert again.next_indices(20) == first + second  # a batch may cross the epoch boundary
    assert PromptSampler(10, seed=4).next_indices(10) != first
    assert PromptSampler(10, seed=3, shuffle=False).next_indices(12) == list(range(10)) + [0, 1]


def test_sampler_resumes_exactly():
    s = PromptSampler(7, seed=1)
    s.next_indices(5)
    s.next_indices(5)  # now in epoch 1
    state = s.state_dict()
    assert state["epoch"] == 1 and state["index"] == 3
    expected = s.next_indices(9)
    r = PromptSampler(7, seed=999)
    r.load_state_dict(state)
    assert r.next_indices(9) == expected
    with pytest.raises(ValueError, match="saved for 7 prompts"):
        PromptSampler(8).load_state_dict(state)
