"""``distill.*`` (features/distill.py): the config refusals, one line each naming the field and what
works; the teacher routing of data rows (``distill.teacher_key``), refused at the row that names no
teacher; the tokenizer check; the planner's rows for teachers this run starts."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.distill.teachers import tokenizer_difference
from gspo_megatron.errors import ConfigError
from gspo_megatron.features.distill import DISTILL, parse_teachers

T = "distill.teachers=['t=http://127.0.0.1:1']"


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["distill.coef=1.0"], r"distill.coef=1.0 needs a teacher: distill.teachers"),
        ([T, "distill.coef=-1"], r"distill.coef must be a finite value >= 0, got -1"),
        ([T, "distill.reward_coef=0"], r"distill.reward_coef=0 with distill.coef=0 leaves nothing to learn"),
        (["distill.teachers=['nourl']", "distill.coef=1"], r"distill.teachers\[0\]='nourl' must be 'NAME=URL"),
        (
            ["distill.teachers=['a=http://h:1','a=http://h:2']", "distill.coef=1"],
            r"distill.teachers\[1\]: the name 'a' is given twice",
        ),
        (
            ["distill.teachers=['a=http://h:1','b=http://h:2']", "distill.coef=1"],
            r"distill.teachers has 2 teachers \(a, b\): distill.teacher_key must name the data column",
        ),
        ([T, "distill.coef=1", "distill.teacher_key=teacher"], r"the built-in data.task 'last_digit' has none"),
        ([T, "distill.coef=1", "distill.batch_size=0"], r"distill.batch_size must be >= 1, got 0"),
        (
            [T, "distill.coef=1", "distill.teacher_mem_fraction=1.5"],
            r"distill.teacher_mem_fraction must be in \(0, 1\)",
        ),
        ([T, "distill.coef=1", "distill.loss=forward"], r"distill.loss"),
    ],
)
def test_refusals_name_the_field(overrides, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        load_config(None, overrides)


def test_a_valid_config_loads_and_enables_the_feature():
    cfg = load_config(None, [T, "distill.coef=0.5", "distill.reward_coef=0"])
    assert DISTILL.enabled(cfg) and cfg.distill.coef == 0.5
    assert not DISTILL.enabled(load_config(None, []))


def test_parse_teachers_urls_and_directories():
    specs, errors = parse_teachers(["a=http://h:1,http://h:2/", "b=/models/teacher"])
    assert not errors
    assert specs[0].urls == ("http://h:1", "http://h:2") and not specs[0].started_here
    assert specs[1].model_path == "/models/teacher" and specs[1].started_here


def _rows(tmp_path, rows):
    p = tmp_path / "data.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def test_rows_are_routed_by_teacher_key_and_an_unknown_teacher_is_refused_at_its_line(tmp_path):
    from gspo_megatron.data.dataset import DatasetError, PromptDataset
    from gspo_megatron.data.tokenizer import load_tokenizer
    from gspo_megatron.factory import build_dataset, hf_init_dir

    teachers = "distill.teachers=['math=http://h:1','code=http://h:2']"
    good = _rows(
        tmp_path, [{"prompt": "1+1=", "label": "2", "src": "math"}, {"prompt": "x", "label": "y", "src": "code"}]
    )
    cfg = load_config(None, [teachers, "distill.coef=1", "distill.teacher_key=src", f"data.path={good}"])
    tok = load_tokenizer(hf_init_dir(cfg))
    ds = build_dataset(cfg, tok)
    assert [r.teacher for r in ds] == ["math", "code"]
    bad = _rows(
        tmp_path, [{"prompt": "1+1=", "label": "2", "src": "math"}, {"prompt": "x", "label": "y", "src": "poetry"}]
    )
    cfg = load_config(None, [teachers, "distill.coef=1", "distill.teacher_key=src", f"data.path={bad}"])
    with pytest.raises(
        DatasetError,
        match=r"data.jsonl line 2: 'src' \(distill.teacher_key\) is 'poetry', which names no teacher; distill.teachers has 'math', 'code'",
    ):
        build_dataset(cfg, tok)
    missing = _rows(tmp_path, [{"prompt": "1+1=", "label": "2"}])
    cfg = load_config(None, [teachers, "distill.coef=1", "distill.teacher_key=src", f"data.path={missing}"])
    with pytest.raises(DatasetError, match=r"missing key 'src' \(distill.teacher_key\)"):
        build_dataset(cfg, tok)
    assert PromptDataset  # (imported for the error type's module)


class _Tok:
    def __init__(self, vocab, eos="</s>"):
        self.vocab, self.eos_token, self.bos_token, self.pad_token, self.unk_token = vocab, eos, None, None, None

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_difference_names_the_first_differing_token():
    a = _Tok({"a": 0, "b": 1, "c": 2})
    assert tokenizer_difference(a, _Tok({"a": 0, "b": 1, "c": 2})) is None
    assert "the student's token 'b' (id 1): the teacher has it as id 2" in tokenizer_difference(
        a, _Tok({"a": 0, "b": 2, "c": 1})
    )
    assert "the student's token 'c' (id 2): the teacher has no such token" in tokenizer_difference(
        a, _Tok({"a": 0, "b": 1})
    )
    assert "the teacher's token 'd' (id 3)" in tokenizer_difference(a, _Tok({"a": 0, "b": 1, "c": 2, "d": 3}))
    assert "eos_token" in tokenizer_difference(a, _Tok({"a": 0, "b": 1, "c": 2}, eos="<eot>"))
