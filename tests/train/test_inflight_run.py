"""Engines that never drain (issue 35): gspo-train with a disaggregated CPU-server engine and
``rollout.inflight_updates`` in each of sglang's pause modes, as a GPU run drives them over HTTP.

- samples live through weight syncs: some hold tokens of two policy versions
  (``rollout/version_span_max``), so the engine kept generating through the sync;
- every trained token's behaviour log-prob equals the engine's log-prob of it (fp32 on CPU): the
  trainer recomputes each token with the weights of the version that sampled it (``retract`` /
  ``abort``: the prefix prefilled again under the new weights), and in ``in_place`` mode the tokens
  sampled over an older KV cache take the engine's own (``rollout/engine_behaviour_tokens``). Were the
  current weights, or one version per sample, used, the gap would be the policy's change;
- no token is older than ``rollout.max_staleness``; ``abort`` resubmits the partial outputs.
"""

from __future__ import annotations

import pytest

from train_utils import CPU_ENGINE_DISAGGREGATED, read_metrics, run_train, write_demo_tokenized_checkpoint

INFLIGHT = [
    *CPU_ENGINE_DISAGGREGATED,
    "rollout.max_staleness=2",
    "rollout.dynamic_sampling=false",
    "rollout.inflight_groups=8",
    "rollout.max_new_tokens=24",
    "model.max_seq_len=64",
    "data.task=add_digits",
    "reward.function=add_digits",
]


@pytest.mark.parametrize(
    "mode, nproc",
    [("retract", 1), ("in_place", 1), ("abort", 1), ("in_place", 2)],
    ids=["retract", "in_place", "abort", "in_place-ep2"],
)
def test_inflight_updates_keep_generating_through_syncs(tmp_path, mode, nproc):
    """nproc 2: EP2 inside DP2 under torchrun; every rank recomputes its tokens with the weights of
    their versions, and rank 0's engine clients pause in the mode while the other ranks wait."""
    out = str(tmp_path / "run")
    layout = ["parallel.ep=2"] if nproc == 2 else []
    run_train(out, [*INFLIGHT, f"rollout.inflight_updates={mode}", "train.steps=5", *layout], nproc=nproc)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert r["rollout/staleness_max"] <= 2, r
        assert r["rollout/logprob_abs_diff"] < 1e-5, r
        assert 0.0 < r["rollout/engine_busy_frac"] <= 1.0 + 1e-9, r
    assert max(r["rollout/version_span_max"] for r in rows) >= 1, rows
    assert max(r["rollout/stale_token_frac"] for r in rows) > 0, rows
    flagged = sum(r["rollout/engine_behaviour_tokens"] for r in rows)
    assert (flagged > 0) if mode == "in_place" else (flagged == 0), rows
    resubmitted = sum(r["rollout/resubmitted_samples"] for r in rows)
    assert (resubmitted > 0) if mode == "abort" else (resubmitted == 0), rows


def test_inflight_updates_reach_speculative_requests_between_cycles(tmp_path):
    """Both generation levers at once: a GLM-4.5 checkpoint with its MTP layer, ``rollout.speculative`` (the
    draft trained and synced with the policy) and in-place in-flight updates. The CPU engine runs one
    draft-verify cycle per scheduler iteration (as sglang's EAGLE worker runs decode steps), so a sync lands
    mid-request: samples span two versions, and the trainer's recompute still equals the engine's
    log-probs token by token."""
    hf_dir = write_demo_tokenized_checkpoint(str(tmp_path / "glm"), "glm4_moe", seed=0, with_mtp=True)
    out = str(tmp_path / "run")
    model = [f"model.hf_path={hf_dir}", "model.init=pretrained", "model.arch=null"]
    spec = ["rollout.speculative=true", "rollout.speculative_steps=2", "gspo.mtp_loss_coef=1.0"]
    run_train(out, [*INFLIGHT, *model, *spec, "rollout.inflight_updates=in_place", "train.steps=5"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for r in rows:
        assert r["rollout/staleness_max"] <= 2, r
        assert r["rollout/logprob_abs_diff"] < 1e-5, r
        assert 1.0 <= r["spec/engine_accept_length"] <= 3.0, r
    assert max(r["rollout/version_span_max"] for r in rows) >= 1, rows
    assert sum(r["rollout/engine_behaviour_tokens"] for r in rows) > 0, rows
