"""Multi-turn records: the record's loss_mask is the loss mask; the GSPO length normalization, the
old log-probs, the engine gap / TIS and the global normalizers count only trained tokens.
Checked against closed-form references written out token by token."""

import math
import random

import pytest
import torch

from gspo_megatron.config import Config
from gspo_megatron.losses.policy_loss import PolicyLossConfig, policy_loss_flat
from gspo_megatron.sample import Sample
from gspo_megatron.trainer.micro_batches import collate
from gspo_megatron.trainer.step import split_batch

LOW, HIGH = 3e-4, 4e-4


def _records(seed=0):
    """Five sequences: interleaved policy (1) / tool (0) runs, one fully untrained sequence."""
    rng = random.Random(seed)
    masks = [[1, 1, 0, 0, 0, 1, 1, 1], [1, 0, 1, 0, 1], [1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 1, 1]]
    recs = []
    for i, m in enumerate(masks):
        p = rng.randint(2, 5)
        recs.append(
            Sample.from_tokens(
                [rng.randrange(1, 50) for _ in range(p + len(m))],
                p,
                loss_mask=m,
                engine_logprobs=[rng.uniform(-3, -0.1) if x else 1e6 for x in m],  # junk off the mask
                advantage=rng.uniform(-1.5, 1.5),
            )
        )
    return recs


def _closed_form(recs, lp, old, eng, tis_cap):
    """(loss, d loss / d lp) written out: log s_i = (1/|y_i|) sum_{t in mask} (lp - old), |y_i| =
    trained tokens; J = mean over sequences with |y_i| > 0 of w_i min(s_i A_i, clip(s_i) A_i),
    w_i = min(exp(mean_{t in mask}(old - eng)), C) (1 without TIS)."""
    live = [i for i, r in enumerate(recs) if sum(r.loss_mask)]
    loss, grad = 0.0, torch.zeros_like(lp, dtype=torch.float64)
    for i in live:
        r = recs[i]
        pos = [r.prompt_len - 1 + j for j, m in enumerate(r.loss_mask) if m]
        n = len(pos)
        log_s = sum(float(lp[i, t]) - float(old[i, t]) for t in pos) / n
        s, A = math.exp(log_s), r.advantage
        w = (
            1.0
            if tis_cap is None
            else min(math.exp(sum(float(old[i, t]) - float(eng[i, t]) for t in pos) / n), tis_cap)
        )
        clipped = min(max(s, 1 - LOW), 1 + HIGH)
        loss -= w * min(s * A, clipped * A) / len(live)
        cut = (A > 0 and s > 1 + HIGH) or (A < 0 and s < 1 - LOW)
        if not cut:
            for t in pos:
                grad[i, t] = -w * s * A / n / len(live)
    return loss, grad


@pytest.mark.parametrize("tis_cap", [None, 1.7])
@pytest.mark.parametrize("spread", [1e-4, 0.3])  # ratios inside the clip range, and clipped ones
def test_gspo_length_normalization_counts_only_trained_tokens(tis_cap, spread):
    recs = _records()
    b = collate(recs, pad_id=0)
    for i, r in enumerate(recs):  # the record's mask, at the label positions of its response
        p, n = r.prompt_len, r.length
        assert b["loss_mask"][i, p - 1 : n - 1].tolist() == [float(x) for x in r.loss_mask]
        assert b["loss_mask"][i].sum() == r.trained_tokens
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(b["labels"].shape, generator=g, dtype=torch.float64) * 3
    lp = (old + spread * torch.randn(old.shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    eng = b["engine_logprobs"].double()
    cfg = PolicyLossConfig(mode="gspo", tis_cap=tis_cap)
    adv = torch.tensor([r.advantage for r in recs], dtype=torch.float64)
    loss, _ = policy_loss_flat(
        lp.reshape(-1),
        old.reshape(-1),
        adv,
        b["loss_mask"].reshape(-1),
        b["seq_index"].reshape(-1),
        len(recs),
        cfg,
        engine_logprobs=eng.reshape(-1),
    )
    loss.backward()
    ref_loss, ref_grad = _closed_form(recs, lp.detach(), old, eng, tis_cap)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-10, atol=1e-14)
    assert lp.grad[b["loss_mask"] == 0].abs().max() == 0  # tool output, prompt, padding: no gradient


def test_an_unmasked_tokens_values_change_nothing():
    """Old, engine and current log-probs off the loss mask (tool output) do not enter the loss."""
    recs = _records(3)
    b = collate(recs, pad_id=0)
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(b["labels"].shape, generator=g, dtype=torch.float64)
    lp = old + 0.2 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    eng = old - 0.1
    adv = torch.tensor([r.advantage for r in recs], dtype=torch.float64)
    cfg = PolicyLossConfig(mode="gspo_token", tis_cap=2.0)
    off = b["loss_mask"] == 0

    def loss(lp, old, eng):
        return policy_loss_flat(
            lp.reshape(-1),
            old.reshape(-1),
            adv,
            b["loss_mask"].reshape(-1),
            b["seq_index"].reshape(-1),
            len(recs),
            cfg,
            engine_logprobs=eng.reshape(-1),
        )[0]

    base = loss(lp, old, eng)
    junk = torch.randn(old.shape, generator=g, dtype=torch.float64) * 5
    assert loss(torch.where(off, junk, lp), torch.where(off, -junk, old), torch.where(off, junk, eng)) == base


@pytest.mark.parametrize("agg, mode", [("seq-mean-token-mean", "gspo"), ("token-mean", "grpo")])
def test_global_normalizer_counts_trained_tokens_and_sequences(agg, mode):
    recs = _records()
    cfg = Config()
    cfg.gspo.mini_batches, cfg.gspo.loss_agg, cfg.gspo.mode = 1, agg, mode
    cfg.parallel.micro_batch_size = 2
    minis = split_batch(cfg, recs, dp=1, dp_rank=0, pad_id=0, multiple=1)
    want = sum(sum(r.loss_mask) for r in recs) if agg == "token-mean" else sum(1 for r in recs if sum(r.loss_mask))
    assert want == (5 + 3 + 3 + 0 + 3 if agg == "token-mean" else 4)
    assert all(mb["normalizer"] == float(want) for mb in minis[0])
