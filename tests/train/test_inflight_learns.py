"""Issue 35's learning check (``-m slow``, ~10 min on 2 cores): on the ``add_digits`` task (not the
demo's), a disaggregated CPU-server run with ``rollout.inflight_updates=retract`` learns as the
synchronous run does on the same seeds: its reward over the last 25 of 150 steps is well above its
first 25 steps' and within reach of the synchronous run's (it trains on samples up to two versions
old, so it is allowed to lag)."""

from __future__ import annotations

import statistics

import pytest

from train_utils import read_metrics, run_train

TASK = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
    "rollout.dynamic_sampling=false",
    "data.task=add_digits",
    "reward.function=add_digits",
    "train.steps=150",
    "rollout.prompts_per_step=16",
    "rollout.group_size=8",
    "rollout.max_new_tokens=2",
    "parallel.micro_batch_size=64",
    "optimizer.lr=0.001",
]


def window(rows, lo, hi):
    return statistics.mean(r["reward/mean"] for r in rows[lo:hi])


@pytest.mark.slow
def test_inflight_run_learns_add_digits_as_the_synchronous_run(tmp_path):
    curves = {}
    for arm, extra in {
        "sync": [],
        "retract": ["rollout.inflight_updates=retract", "rollout.max_staleness=2"],
    }.items():
        out = str(tmp_path / arm)
        run_train(out, [*TASK, *extra], timeout=1800)
        curves[arm] = read_metrics(out)
    sync, inflight = curves["sync"], curves["retract"]
    assert len(sync) == len(inflight) == 150
    assert window(inflight, 125, 150) > 3 * window(inflight, 0, 25)
    assert window(inflight, 125, 150) > 0.6 * window(sync, 125, 150)
    assert all(r["rollout/logprob_abs_diff"] < 1e-5 for r in inflight)
