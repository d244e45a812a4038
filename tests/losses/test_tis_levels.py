"""Engine/trainer importance weights (``gspo.tis_cap``, ``tis_level``, ``tis_mode``) against a hand
computation: the sequence weight is the geometric mean of the per-token ratios exp(old - engine)
over the response tokens (never their product), truncated at the cap or masked (the sequence dropped
when it exceeds the cap); the token weight is per token. Loss and gradient in float64."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.losses import PolicyLossConfig
from gspo_megatron.losses.policy_loss import policy_loss, tis_weights

CLIP = (0.2, 0.3)  # wide, so the clipped branch is rarely taken and the weights are what is tested


def _batch():
    """3 sequences x 5 positions, float64. Mean engine log-ratio per sequence: 0.02, 0.3, -0.1."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float64)
    old = -torch.rand(3, 5, dtype=torch.float64) - 0.5
    gap = torch.tensor(
        [[0.05, -0.01, 0.02, 9.0, 9.0], [0.3, 0.1, 0.5, 0.2, 0.4], [9.0, -0.1, -0.2, 0.0, 9.0]], dtype=torch.float64
    )  # old - engine (9.0 off the response: must not count)
    engine = old - gap
    lp = (old + 0.05 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    return lp, old, engine, adv, mask, gap


def _hand(lp, old, adv, mask, gap, mode, cap, level, tis_mode):
    """Loss and d loss / d lp from the formulas, one scalar at a time (autograd on the scalar graph)."""
    x = lp.detach().clone().requires_grad_(True)
    total = 0.0
    n_seq = 0
    for i in range(3):
        toks = [t for t in range(5) if mask[i, t] > 0]
        n = len(toks)
        n_seq += 1
        rho_seq = math.exp(sum(float(gap[i, t]) for t in toks) / n)  # geometric mean of exp(gap_t)

        def w(rho):
            if tis_mode == "truncate":
                return min(rho, cap)
            return rho if rho <= cap else 0.0

        if mode == "gspo":
            s = torch.exp(sum(x[i, t] - old[i, t] for t in toks) / n)
            j = torch.minimum(s * adv[i], s.clamp(1 - CLIP[0], 1 + CLIP[1]) * adv[i])
            total = total + w(rho_seq) * j
        else:  # grpo, seq-mean-token-mean
            for t in toks:
                r = torch.exp(x[i, t] - old[i, t])
                j = torch.minimum(r * adv[i], r.clamp(1 - CLIP[0], 1 + CLIP[1]) * adv[i])
                wt = w(rho_seq) if level == "sequence" else w(math.exp(float(gap[i, t])))
                total = total + wt * j / n
    loss = -total / n_seq
    loss.backward()
    return float(loss), x.grad


@pytest.mark.parametrize("mode,level", [("gspo", "sequence"), ("grpo", "sequence"), ("grpo", "token")])
@pytest.mark.parametrize("tis_mode", ["truncate", "mask"])
def test_weights_match_the_hand_computation(mode, level, tis_mode):
    lp, old, engine, adv, mask, gap = _batch()
    cap = 1.2  # sequence rho: exp(0.02), exp(0.3) = 1.35 > cap, exp(-0.1)
    out = policy_loss(
        lp,
        old,
        adv,
        mask,
        mode=mode,
        clip_low=CLIP[0],
        clip_high=CLIP[1],
        engine_logprobs=engine,
        tis_cap=cap,
        tis_level=level,
        tis_mode=tis_mode,
    )
    out.loss.backward()
    want, grad = _hand(lp, old, adv, mask, gap, mode, cap, level, tis_mode)
    assert out.loss.item() == pytest.approx(want, rel=1e-12, abs=1e-14)
    torch.testing.assert_close(lp.grad * mask, grad * mask, rtol=1e-10, atol=1e-14)
    if level == "sequence":
        assert out.metrics["tis_capped_fraction"] == pytest.approx(1 / 3, rel=1e-6)
        rho = [math.exp(sum(float(gap[i, t]) for t in range(5) if mask[i, t]) / int(mask[i].sum())) for i in range(3)]
        kept = [min(r, cap) if tis_mode == "truncate" else (r if r <= cap else 0.0) for r in rho]
        assert out.metrics["tis_weight_mean"] == pytest.approx(sum(kept) / 3, rel=1e-6)


def test_mask_drops_the_sequence_over_the_cap():
    """Mask mode: sequence 1 (rho = exp(0.3) > 1.2) contributes nothing, neither to the loss nor to the
    gradient; the others keep their full weight rho_i (not truncated)."""
    lp, old, engine, adv, mask, _ = _batch()
    out = policy_loss(
        lp,
        old,
        adv,
        mask,
        mode="gspo",
        engine_logprobs=engine,
        tis_cap=1.2,
        tis_mode="mask",
        clip_low=CLIP[0],
        clip_high=CLIP[1],
    )
    out.loss.backward()
    assert torch.all(lp.grad[1] == 0)
    assert (lp.grad[0] * mask[0]).abs().sum() > 0 and (lp.grad[2] * mask[2]).abs().sum() > 0
    # the same loss with sequence 1's advantage zeroed and no TIS, the others weighted by hand
    lp2 = lp.detach().clone().requires_grad_(True)
    rho = torch.tensor([math.exp(0.02), 0.0, math.exp(-0.1)], dtype=torch.float64)
    plain = policy_loss(lp2, old, adv * rho, mask, mode="gspo", clip_low=CLIP[0], clip_high=CLIP[1])
    # (with clipping inactive, w_i * min(s A, clip(s) A) == min(s (w A), clip(s) (w A)) for w >= 0)
    assert out.loss.item() == pytest.approx(plain.loss.item(), rel=1e-12)


def test_sequence_weight_is_the_geometric_mean_not_the_product():
    """200 tokens each with ratio 1.01: the product is 1.01^200 = 7.3; the length-normalized weight is 1.01,
    under a cap of 1.05 (truncate: not capped; mask: not dropped)."""
    n = 200
    old = torch.full((1, n), -1.0, dtype=torch.float64)
    engine = old - math.log(1.01)
    lp = old.clone().requires_grad_(True)
    for tis_mode in ("truncate", "mask"):
        out = policy_loss(
            lp,
            old,
            torch.ones(1, dtype=torch.float64),
            torch.ones(1, n),
            mode="gspo",
            engine_logprobs=engine,
            tis_cap=1.05,
            tis_mode=tis_mode,
        )
        assert out.metrics["tis_weight_mean"] == pytest.approx(1.01, rel=1e-6)  # metrics are float32
        assert out.metrics["tis_capped_fraction"] == 0.0
        assert out.loss.item() == pytest.approx(-1.01, rel=1e-9)


def test_tis_weights_and_defaults():
    w, capped = tis_weights(torch.log(torch.tensor([0.5, 1.0, 2.0, 3.0])), 2.0, "truncate")
    assert w.tolist() == pytest.approx([0.5, 1.0, 2.0, 2.0]) and capped.tolist() == [False, False, True, True]
    w, capped = tis_weights(torch.log(torch.tensor([0.5, 1.0, 2.0, 3.0])), 2.0, "mask")
    assert w.tolist() == pytest.approx([0.5, 1.0, 2.0, 0.0]) and capped.tolist() == [False, False, False, True]
    assert PolicyLossConfig(mode="gspo").tis_level == "sequence"
    assert PolicyLossConfig(mode="gspo_token").tis_level == "sequence"
    assert PolicyLossConfig(mode="grpo").tis_level == "token"
    with pytest.raises(ValueError, match="tis_level='token' weights tokens, but mode='gspo'"):
        PolicyLossConfig(mode="gspo", tis_level="token")
    with pytest.raises(ValueError, match="tis_mode must be one of"):
        PolicyLossConfig(tis_mode="clip")
    with pytest.raises(ValueError, match="tis_level must be one of"):
        PolicyLossConfig(tis_level="batch")


def test_gspo_token_token_level_weights_each_token():
    """gspo_token at tis_level=token: each token's term times its own weight; with uniform gaps it equals
    the sequence level (every token ratio equals the geometric mean)."""
    lp, old, _, adv, mask, _ = _batch()
    engine = old - 0.05
    a = policy_loss(lp, old, adv, mask, mode="gspo_token", engine_logprobs=engine, tis_cap=2.0, tis_level="token")
    b = policy_loss(lp, old, adv, mask, mode="gspo_token", engine_logprobs=engine, tis_cap=2.0)
    assert a.loss.item() == pytest.approx(b.loss.item(), rel=1e-12)


def test_config_refuses_token_level_for_gspo():
    from gspo_megatron.config import load_config
    from gspo_megatron.errors import ConfigError

    with pytest.raises(ConfigError, match="gspo.tis_level=token is not allowed with gspo.mode=gspo"):
        load_config(None, ["gspo.tis_cap=2", "gspo.tis_level=token"])
    cfg = load_config(None, ["gspo.mode=grpo", "gspo.tis_cap=2", "gspo.tis_level=sequence", "gspo.tis_mode=mask"])
    from gspo_megatron.trainer.step import loss_config

    lc = loss_config(cfg)
    assert (lc.tis_level, lc.tis_mode, lc.tis_cap) == ("sequence", "mask", 2.0)
