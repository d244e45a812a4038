"""The Megatron loss function under Megatron-Core's real forward-backward schedule (no pipelining, gloo):
1 vs 2 vs 4 micro-batches, padded vs packed (THD), DP1 vs DP2 with Megatron DDP -- all must give the
gradient of the single-call global-batch loss."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.losses import PolicyLossConfig, check_megatron_config
from megatron_loss_workers import logprob_worker, reference_grads, schedule_worker

CFGS = {
    "gspo": PolicyLossConfig(mode="gspo", clip_low=3e-3, clip_high=4e-3, entropy_coef=0.01),
    "grpo_token_mean": PolicyLossConfig(
        mode="grpo", clip_low=5e-3, clip_high=5e-3, aggregation="token-mean", entropy_coef=0.01
    ),
}


def assert_matches(result, ref, what):
    loss_sum, grads, clip_fraction = result
    ref_loss, ref_grads = ref
    assert clip_fraction > 0, what  # the clipped branch is exercised
    assert loss_sum == pytest.approx(ref_loss.item(), rel=1e-6, abs=1e-8), what
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-8, msg=f"{what}: {name}")


def test_microbatches_and_packing_single_rank():
    runs = []
    for cfg in CFGS.values():
        runs += [
            (cfg, "padded", 1, None),
            (cfg, "padded", 4, None),
            (cfg, "packed", 2, None),
            (cfg, "packed", 3, None),
            (cfg, "padded", 2, True),
        ]
    results = run_ranks(schedule_worker, 1, runs)[0]
    refs = {id(cfg): reference_grads(cfg) for cfg in CFGS.values()}
    for run, result in zip(runs, results):
        assert_matches(result, refs[id(run[0])], f"{run[0].mode} {run[1:]}")


def test_dp2_with_megatron_ddp():
    """Two DP ranks, each with half the sequences; Megatron DDP reduces (either collective setting)."""
    cfg = CFGS["gspo"]
    runs = [(cfg, "packed", 2, False), (cfg, "padded", 1, True)]
    results = run_ranks(schedule_worker, 2, runs)
    ref = reference_grads(cfg)
    for k, run in enumerate(runs):
        loss_sum = results[0][k][0] + results[1][k][0]  # each DP rank holds its share of the loss
        for r in range(2):
            _, grads, _ = results[r][k]
            assert_matches((loss_sum, grads, max(results[0][k][2], results[1][k][2])), ref, f"dp2 rank {r} {run[1:]}")


def test_forward_only_logprob_collection():
    collected, direct = run_ranks(logprob_worker, 1, 3)[0]
    assert len(collected) == 3
    for (lp, ent), (ref_lp, ref_ent) in zip(collected, direct):
        assert not lp.requires_grad
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=0)
        torch.testing.assert_close(ent, ref_ent, rtol=0, atol=0)


def test_per_token_loss_config_refused():
    class Cfg:
        calculate_per_token_loss = True

    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        check_megatron_config(Cfg())
