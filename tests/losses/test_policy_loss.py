"""policy_loss against the closed-form reference (value and gradient) for every mode and option."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.losses import PolicyLossConfig, policy_loss, policy_loss_flat
from loss_reference import reference_loss

B, T = 6, 7


def make_batch(seed: int, *, spread: float = 1e-3, token_adv: bool = False, empty_row: bool = True):
    """float64 batch whose sequence ratios straddle the GSPO clip range (and GRPO's for spread ~0.3)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    shift = (torch.rand(B, 1, generator=g, dtype=torch.float64) * 2 - 1) * spread
    noise = (torch.rand(B, T, generator=g, dtype=torch.float64) * 2 - 1) * spread
    lp = old + shift + noise
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    mask[:, 0] = 0.0  # a prompt token
    mask[1, 0] = 1.0
    if empty_row:
        mask[2] = 0.0
    adv = torch.randn(B, T if token_adv else 1, generator=g, dtype=torch.float64).squeeze(-1)
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    engine = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    return lp, old, adv, mask, ref, ent, engine


def run_both(lp, old, adv, mask, *, ref=None, ent=None, engine=None, **kw):
    lp = lp.clone().requires_grad_(True)
    ent_t = ent.clone().requires_grad_(True) if ent is not None else None
    loss, metrics = policy_loss(lp, old, adv, mask, ref_logprobs=ref, entropy=ent_t, engine_logprobs=engine, **kw)
    loss.backward()
    cfg = PolicyLossConfig(**{k: v for k, v in kw.items() if k in PolicyLossConfig.__dataclass_fields__})
    as_list = lambda x: None if x is None else x.tolist()
    ref_val, ref_glp, ref_gent = reference_loss(
        lp.detach().tolist(),
        old.tolist(),
        adv.tolist(),
        mask.tolist(),
        mode=cfg.mode,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        aggregation=cfg.aggregation,
        ref=as_list(ref),
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        ent=as_list(ent),
        ent_coef=cfg.entropy_coef,
        engine=as_list(engine),
        tis_cap=cfg.tis_cap,
        normalizer=kw.get("normalizer"),
    )
    torch.testing.assert_close(loss.detach(), torch.tensor(ref_val, dtype=torch.float64), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(lp.grad, torch.tensor(ref_glp, dtype=torch.float64), rtol=1e-9, atol=1e-13)
    if ent_t is not None:
        torch.testing.assert_close(ent_t.grad, torch.tensor(ref_gent, dtype=torch.float64), rtol=1e-9, atol=1e-13)
    return loss, metrics, lp.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_closed_form(seed):
    lp, old, adv, mask, *_ = make_batch(seed)
    _, metrics, grad = run_both(lp, old, adv, mask, mode="gspo")
    assert metrics["num_seqs"] == B - 1
    assert grad.abs().sum() > 0


def test_gspo_batch_mixes_clipped_and_unclipped():
    """The closed-form batches exercise both branches: sequences cut off by the clip and not."""
    fractions = [policy_loss(*make_batch(seed)[:4], mode="gspo")[1]["clip_fraction"] for seed in (0, 1, 2)]
    assert any(0 < f < 1 for f in fractions), fractions


@pytest.mark.parametrize("seed", [0, 3])
def test_gspo_token_closed_form(seed):
    lp, old, adv, mask, *_ = make_batch(seed, token_adv=True)
    run_both(lp, old, adv, mask, mode="gspo_token")


@pytest.mark.parametrize("seed", [0, 4])
@pytest.mark.parametrize("aggregation", ["seq-mean-token-mean", "token-mean"])
def test_grpo_closed_form(seed, aggregation):
    lp, old, adv, mask, *_ = make_batch(seed, spread=0.3)
    _, metrics, _ = run_both(lp, old, adv, mask, mode="grpo", aggregation=aggregation)
    assert 0 < metrics["clip_fraction"] < 1


def test_grpo_token_advantages_closed_form():
    lp, old, adv, mask, *_ = make_batch(5, spread=0.3, token_adv=True)
    run_both(lp, old, adv, mask, mode="grpo", clip_low=0.1, clip_high=0.28)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("mode", ["gspo", "gspo_token", "grpo"])
def test_kl_entropy_closed_form(estimator, mode):
    lp, old, adv, mask, ref, ent, _ = make_batch(6)
    _, metrics, _ = run_both(
        lp, old, adv, mask, mode=mode, ref=ref, kl_coef=0.05, kl_estimator=estimator, ent=ent, entropy_coef=0.01
    )
    assert "kl_ref" in metrics and "entropy" in metrics


@pytest.mark.parametrize("mode", ["gspo", "gspo_token", "grpo"])
def test_tis_closed_form(mode):
    lp, old, adv, mask, _, _, engine = make_batch(7, spread=0.3 if mode == "grpo" else 1e-3)
    _, metrics, _ = run_both(lp, old, adv, mask, mode=mode, engine=engine, tis_cap=1.1 if mode == "grpo" else 1.02)
    assert 0 < metrics["tis_capped_fraction"] < 1
    assert metrics["engine_logprob_absdiff"] > 0


def test_global_normalizer_closed_form():
    lp, old, adv, mask, *_ = make_batch(8)
    run_both(lp, old, adv, mask, mode="gspo", normalizer=37)
    run_both(lp, old, adv, mask, mode="grpo", aggregation="token-mean", normalizer=torch.tensor(101.0))


@pytest.mark.parametrize("seed", [0, 1, 9])
def test_gspo_token_equals_gspo_for_uniform_token_advantages(seed):
    lp, old, adv, mask, *_ = make_batch(seed)
    adv_tok = adv[:, None].expand(B, T).contiguous()
    grads, values = [], []
    for mode, a in (("gspo", adv), ("gspo_token", adv_tok)):
        x = lp.clone().requires_grad_(True)
        loss, metrics = policy_loss(x, old, a, mask, mode=mode)
        loss.backward()
        grads.append(x.grad)
        values.append(loss.detach())
    torch.testing.assert_close(values[0], values[1], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-15)
    assert grads[0].abs().sum() > 0


def test_micro_batches_sum_to_global_mean():
    """Per micro-batch losses with the global normalizer add up to the whole-batch loss and gradient."""
    lp, old, adv, mask, ref, ent, engine = make_batch(10)
    full = lp.clone().requires_grad_(True)
    kw = dict(mode="gspo", kl_coef=0.1)
    loss_full, _ = policy_loss(full, old, adv, mask, ref_logprobs=ref, **kw)
    loss_full.backward()
    n_seqs = int((mask.sum(1) > 0).sum())
    part = lp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4), slice(4, 6)):  # micro-batch 2 holds the empty row
        loss, _ = policy_loss(
            part[rows], old[rows], adv[rows], mask[rows], ref_logprobs=ref[rows], normalizer=n_seqs, **kw
        )
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, loss_full.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(part.grad, full.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("mode", ["gspo", "gspo_token", "grpo"])
def test_packed_equals_padded(mode):
    """Flat packed tokens (seq_index from segments, shuffled, with padding) == the padded [B, T] call."""
    lp, old, adv, mask, ref, ent, _ = make_batch(11, spread=0.3 if mode == "grpo" else 1e-3)
    padded = lp.clone().requires_grad_(True)
    loss_pad, m_pad = policy_loss(padded, old, adv, mask, mode=mode, ref_logprobs=ref, kl_coef=0.02)
    loss_pad.backward()

    rows, cols = mask.nonzero(as_tuple=True)
    extra = torch.tensor([0, 1, 3])  # padding tokens with garbage values and any seq index
    perm = torch.randperm(rows.numel() + extra.numel(), generator=torch.Generator().manual_seed(0))
    packed = lp.clone().requires_grad_(True)
    vals = lambda x, pad: torch.cat([x[rows, cols], pad])[perm]
    nanpad = torch.full((3,), float("nan"), dtype=torch.float64)
    loss_pack, m_pack = policy_loss_flat(
        vals(packed, nanpad),
        vals(old, nanpad),
        adv,
        vals(mask, torch.zeros(3, dtype=torch.float64)),
        torch.cat([rows, torch.tensor([5, 0, 99])])[perm],
        B,
        PolicyLossConfig(mode=mode, kl_coef=0.02),
        ref_logprobs=vals(ref, nanpad),
    )
    loss_pack.backward()
    torch.testing.assert_close(loss_pack.detach(), loss_pad.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(packed.grad, padded.grad, rtol=1e-12, atol=1e-15)
    for k in ("ratio_mean", "ratio_min", "ratio_max", "num_seqs", "num_tokens", "approx_kl_old", "kl_ref"):
        assert m_pack[k] == pytest.approx(m_pad[k], rel=1e-6), k


def test_metrics_against_manual():
    lp, old, adv, mask, *_ = make_batch(12)
    _, m = policy_loss(lp, old, adv, mask, mode="gspo")
    n = mask.sum(1)
    valid = n > 0
    s = torch.exp(((lp - old) * mask).sum(1) / n.clamp(min=1))[valid]
    a = adv[valid]
    cut = ((a > 0) & (s > 1 + 4e-4)) | ((a < 0) & (s < 1 - 3e-4))
    r = torch.exp(lp - old)
    k3 = ((r - 1 - (lp - old)) * mask).sum(1)[valid] / n[valid]
    assert m["ratio_mean"] == pytest.approx(s.mean().item(), rel=1e-6)
    assert m["ratio_min"] == pytest.approx(s.min().item(), rel=1e-6)
    assert m["ratio_max"] == pytest.approx(s.max().item(), rel=1e-6)
    assert m["clip_fraction"] == pytest.approx(cut.double().mean().item())
    assert m["approx_kl_old"] == pytest.approx(k3.mean().item(), rel=1e-5)
    assert m["num_tokens"] == mask.sum().item()
    assert isinstance(m["loss"], float)


def test_default_clip_ranges():
    assert (PolicyLossConfig(mode="gspo").clip_low, PolicyLossConfig(mode="gspo").clip_high) == (3e-4, 4e-4)
    assert (PolicyLossConfig(mode="grpo").clip_low, PolicyLossConfig(mode="grpo").clip_high) == (0.2, 0.2)


def test_fp32_bf16_inputs_run_in_fp32():
    lp, old, adv, mask, *_ = make_batch(13)
    x = lp.float().requires_grad_(True)
    loss, _ = policy_loss(x, old.bfloat16(), adv.float(), mask.bool(), mode="gspo")
    assert loss.dtype == torch.float32
    loss.backward()
    assert x.grad.dtype == torch.float32
