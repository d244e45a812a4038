"""Off-policy overlap (issue 12), fast parts: the producer's staleness schedule against a fake engine
whose batches take random time, finish-first syncs, data order after a failure or a resume, the
weight history the trainer recomputes behaviour log-probs with, per-token weight versions from
SGLang's meta_info, and the colocated start-up error. The end-to-end runs are in
tests/train/test_offpolicy.py."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from gspo_megatron.data.dataset import PromptSampler
from gspo_megatron.engines.sglang_client import SGLangError
from gspo_megatron.engines.sglang_engine import parse_output, token_versions
from gspo_megatron.orchestration.async_producer import AsyncProducer, Overlap
from gspo_megatron.orchestration.batch import RolloutBatch
from gspo_megatron.sample import Sample
from gspo_megatron.trainer.behaviour_policy import WeightHistory

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class FakeFleet:
    """An engine that serves one weight version at a time (a sync's version string), a sync that
    bumps it, and random generation / sync times. Records every overlap of a sync with a batch."""

    def __init__(self, sampler: PromptSampler, rng: random.Random, fail_at: int | None = None):
        self.sampler, self.rng, self.fail_at = sampler, rng, fail_at
        self.version = "default"
        self.generating = self.syncing = False
        self.violations: list[str] = []
        self.syncer = type("Syncer", (), {"version": 0})()
        self.lock = threading.Lock()

    def collect(self, step: int) -> RolloutBatch:
        with self.lock:
            if self.syncing:
                self.violations.append(f"batch {step} started during a sync")
            self.generating = True
        idx = self.sampler.next_indices(2)
        time.sleep(self.rng.random() * 0.01)
        if self.fail_at == step:
            self.fail_at = None
            self.generating = False
            raise RuntimeError("engine died")
        recs = [Sample(prompt_ids=[i], response_ids=[1, 2, 3], token_versions=[self.version] * 3) for i in idx]
        self.generating = False
        return RolloutBatch(records=recs, metrics={})

    def sync(self) -> dict:
        with self.lock:
            if self.generating:
                self.violations.append("sync during generation")
            self.syncing = True
        time.sleep(self.rng.random() * 0.01)
        self.syncer.version += 1
        self.version = str(self.syncer.version)
        self.syncing = False
        return {}


def run_loop(
    n: int, start: int, last: int, seed: int, sampler_state: dict | None = None, fail_at: int | None = None
) -> tuple[list[dict], FakeFleet, AsyncProducer]:
    """The trainer's loop (train.py's order: sync; then per step take, train, sync) on the overlap."""
    rng = random.Random(seed)
    sampler = PromptSampler(50, seed=3)
    if sampler_state is not None:
        sampler.load_state_dict(sampler_state)
    fleet = FakeFleet(sampler, rng, fail_at)
    history = WeightHistory(torch.nn.Linear(2, 2), n, start)
    producer = AsyncProducer(fleet.collect, sampler, n, start, last, history)
    overlap = Overlap(fleet.syncer, history, producer)

    def sync() -> dict:  # RolloutSession.sync with the overlap as its sync hook
        return overlap.around_sync(fleet.sync)

    sync()
    steps = []
    s = start + 1
    while s <= last:
        position = producer.state_dict()
        try:
            batch = overlap.collect(s)
        except RuntimeError:  # RolloutSession: back to the consumed position, re-sync, retry the step
            producer.load_state_dict(position)
            sync()
            continue
        steps.append(
            dict(
                step=s,
                trainer=history.current,
                prompts=[r.prompt_ids[0] for r in batch.records],
                versions=[r.behaviour_version for r in batch.records],
                metrics=batch.metrics,
                consumed=producer.state_dict(),
            )
        )
        time.sleep(rng.random() * 0.01)  # training
        history.trained()
        steps[-1]["sync"] = sync()
        s += 1
    overlap.close()
    return steps, fleet, producer


@pytest.mark.parametrize("n", [1, 2, 3])
def test_schedule_bounds_staleness_and_never_overlaps_a_sync(n):
    for seed in range(3):
        steps, fleet, _ = run_loop(n, start=0, last=8, seed=seed)
        assert fleet.violations == []
        assert [s["step"] for s in steps] == list(range(1, 9))
        for s in steps:
            # the fixed schedule: step s's batch comes from policy version max(start, s - 1 - N)
            want = max(0, s["step"] - 1 - n)
            assert all(v == [want] * 3 for v in s["versions"]), s
            assert s["trainer"] == s["step"] - 1
            ages = [s["trainer"] - min(v) for v in s["versions"]]
            assert s["metrics"]["rollout/staleness_max"] == max(ages) <= n
            assert s["metrics"]["rollout/staleness_mean"] == pytest.approx(sum(ages) / len(ages))
            assert s["metrics"]["rollout/engine_policy_version"] == want
            for k in ("rollout/trainer_wait_s", "rollout/engine_wait_s"):
                assert s["metrics"][k] >= 0.0
            assert s["sync"]["rollout/sync_wait_s"] >= 0.0
        assert steps[-1]["metrics"]["rollout/staleness_max"] == n  # the bound is reached, not undershot


def test_resumed_producer_trains_on_the_same_prompts():
    full, _, _ = run_loop(2, start=0, last=8, seed=0)
    # a kill after step 4: the checkpoint holds the position after the last consumed batch; the
    # pending batches (steps 5, 6) are regenerated by the resumed run, from version 4
    resumed, fleet, _ = run_loop(2, start=4, last=8, seed=1, sampler_state=full[3]["consumed"])
    assert fleet.violations == []
    assert [s["prompts"] for s in resumed] == [s["prompts"] for s in full[4:]]
    assert [max(max(v) for v in s["versions"]) for s in resumed] == [4, 4, 4, 5]
    assert [s["metrics"]["rollout/staleness_max"] for s in resumed] == [0, 1, 2, 2]


def test_failed_batch_is_retried_with_the_same_prompts():
    full, _, _ = run_loop(1, start=0, last=6, seed=0)
    failed, fleet, _ = run_loop(1, start=0, last=6, seed=0, fail_at=4)
    assert fleet.violations == []
    assert [s["prompts"] for s in failed] == [s["prompts"] for s in full]
    for s in failed:
        assert s["metrics"]["rollout/staleness_max"] <= 1


def test_stale_sample_beyond_the_bound_is_refused():
    sampler = PromptSampler(10, seed=0)
    history = WeightHistory(torch.nn.Linear(2, 2), 1, 0)
    history.synced(1)  # "1" -> policy 0
    history.trained()
    history.synced(2)  # "2" -> policy 1
    history.trained()
    history.synced(3)

    def collect(step):
        return RolloutBatch(
            records=[Sample(prompt_ids=[0], response_ids=[1, 2], token_versions=["1", "1"])], metrics={}
        )

    producer = AsyncProducer(collect, sampler, 1, 2, 5, history)
    producer.engine_version = 2
    with pytest.raises(RuntimeError, match="more than rollout.max_staleness=1"):
        producer.take(3, trainer_version=2)
    producer.close()


def test_weight_history_swaps_and_restores():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    h = WeightHistory(model, max_staleness=1, policy_version=5)
    w5 = model.weight.detach().clone()
    h.synced(1)
    with torch.no_grad():
        model.weight.add_(1.0)
    h.trained()
    h.synced(2)
    w6 = model.weight.detach().clone()
    assert h.policy_version("1") == 5 and h.policy_version("2") == 6
    with h.weights(5):
        assert torch.equal(model.weight, w5)
    assert torch.equal(model.weight, w6)
    with h.weights(6):
        assert torch.equal(model.weight, w6)
    with torch.no_grad():
        model.weight.add_(1.0)
    h.trained()
    h.synced(3)  # keeps versions 6 and 7 (max_staleness=1)
    assert sorted(h.snapshots) == [6, 7]
    with pytest.raises(RuntimeError, match="no copy of policy version 5"):
        with h.weights(5):
            pass
    with pytest.raises(RuntimeError, match="weight version 'x'"):
        h.policy_version("x")


def test_token_versions_follow_sglang_spans():
    meta = {
        "weight_version": "3",
        "weight_versions": [{"version": "2", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 5}],
    }
    assert token_versions(meta, 5) == ["2", "2", "3", "3", "3"]
    assert token_versions({"weight_version": "7"}, 2) == ["7", "7"]
    assert token_versions({}, 2) is None
    with pytest.raises(SGLangError, match="does not cover"):
        token_versions({"weight_versions": [{"version": "1", "start": 0, "end": 1}]}, 2)
    out = {
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[-0.5, 11, None], [-0.1, 2, None]],
            "weight_version": "4",
            "weight_versions": [{"version": "4", "start": 0, "end": 2}],
        }
    }
    assert parse_output([1], out).token_versions == ["4", "4"]


def test_colocated_staleness_fails_at_start_up_with_the_reason(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "gspo_megatron.train",
        "--config",
        os.path.join(REPO, "configs/demo_cpu.yaml"),
        f"output_dir={tmp_path / 'run'}",
        "rollout.engine=sglang",
        "rollout.engine_server=cpu",
        "rollout.sync_mode=colocated",
        "rollout.max_staleness=1",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = [x for x in proc.stderr.splitlines() if "max_staleness" in x]
    assert line and "rollout.sync_mode=disaggregated" in line[0] and "colocated" in line[0], proc.stderr
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
