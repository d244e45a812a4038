"""The typed record (gspo_megatron/sample.py): what its derived values are, how both collates lay its
fields on a row, and the one-line errors when a micro-batch's Samples disagree or a field has the
wrong length."""

from __future__ import annotations

import pickle

import pytest
import torch

from gspo_megatron.sample import PER_TOKEN_FIELDS, Sample
from gspo_megatron.trainer.micro_batches import collate
from gspo_megatron.trainer.packing import collate_packed


def _sample(p=3, r=4, **kw):
    return Sample.from_tokens(list(range(10, 10 + p + r)), p, **kw)


def test_derived_values():
    s = _sample(2, 5, loss_mask=[1, 0, 0, 1, 1], finish_reason="length")
    assert s.prompt_ids == [10, 11] and s.response_ids == [12, 13, 14, 15, 16]
    assert s.tokens == list(range(10, 17)) and (s.prompt_len, s.response_len, s.length) == (2, 5, 7)
    assert s.trained_tokens == 3 and s.truncated
    plain = _sample(2, 5)
    assert plain.trained_tokens == 5 and not plain.truncated
    # what the session broadcasts: a pickle round trip keeps every field
    assert pickle.loads(pickle.dumps(s)) == s


@pytest.mark.parametrize("packed", [False, True])
def test_fields_land_on_the_label_positions(packed):
    """Every per-token field, the loss mask and the advantage at the positions that predict the
    response tokens (position p - 1 + j predicts response token j)."""
    recs = []
    for i, (p, r) in enumerate([(2, 3), (1, 4), (3, 1)]):
        vals = {k: [100 * i + 10 * n + j for j in range(r)] for n, k in enumerate(PER_TOKEN_FIELDS)}
        recs.append(_sample(p, r, advantage=0.5 - i, loss_mask=[(i + j) % 2 for j in range(r)], **vals))
    b = collate_packed(recs) if packed else collate(recs)
    assert torch.equal(b["advantages"], torch.tensor([0.5, -0.5, -1.5]))
    starts = b["cu_seqlens"][:-1].tolist() if packed else [0, 0, 0]
    for i, (rec, a) in enumerate(zip(recs, starts)):
        row = 0 if packed else i
        pos = slice(a + rec.prompt_len - 1, a + rec.length - 1)
        assert b["tokens"][row, a : a + rec.length].tolist() == rec.tokens
        assert b["loss_mask"][row, pos].tolist() == [float(m) for m in rec.loss_mask]
        for k in PER_TOKEN_FIELDS:
            assert b[k][row, pos].tolist() == [float(v) for v in getattr(rec, k)]
    assert b["loss_mask"].sum() == sum(r.trained_tokens for r in recs)


def test_a_field_the_first_sample_lacks_is_not_collated():
    b = collate([_sample(), _sample(engine_logprobs=[-1.0] * 4, advantage=1.0)])
    assert "engine_logprobs" not in b and "old_logprobs" not in b and "advantages" not in b


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize(
    "second, message",
    [
        (
            dict(engine_logprobs=None, advantage=1.0),
            "sequence 1: engine_logprobs is None while the micro-batch's first",
        ),
        (
            dict(engine_logprobs=[-1.0] * 3, advantage=1.0),
            "sequence 1: engine_logprobs has 3 values for 4 response tokens",
        ),
        (
            dict(engine_logprobs=[-1.0] * 4, advantage=None),
            "sequence 1: advantage is None while the micro-batch's first",
        ),
        (dict(engine_logprobs=[-1.0] * 4, advantage=1.0, loss_mask=[1, 0]), "sequence 1: loss_mask has 2 values for 4"),
    ],
)
def test_disagreeing_samples_fail_with_one_line_naming_the_field(packed, second, message):
    recs = [_sample(engine_logprobs=[-1.0] * 4, advantage=0.0), _sample(**second)]
    with pytest.raises(ValueError, match=message):
        (collate_packed if packed else collate)(recs)


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match=r"sequence 0: prompt_len 0 outside \[1, 4\]"):
        collate([Sample(prompt_ids=[], response_ids=[1, 2, 3, 4])])
