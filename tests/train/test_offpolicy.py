"""Off-policy overlap end to end (issue 12): gspo-train with disaggregated CPU-server engines
(``rollout.engine=sglang rollout.engine_server=cpu``) and ``rollout.max_staleness`` N >= 1.

- the staleness schedule shows in the metrics (never above N), the engines' policy version follows it;
- the behaviour log-probs the trainer recomputes with the generating weights equal the engine's own
  log-probs of the stale samples (both fp32 on CPU): were the current weights used, they would differ;
- a run killed (SIGKILL) after a checkpoint resumes with the same command and finishes, its pending
  batches regenerated from the resumed weights.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from subprocess_utils import popen_group
from train_utils import FAST, REPO, read_metrics, run_train, train_cmd, train_env

DISAGG = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
]


def test_killed_offpolicy_run_resumes(tmp_path):
    out = str(tmp_path / "run")
    steps = 5
    cmd = train_cmd(out, [*FAST, *DISAGG, "rollout.max_staleness=2", f"train.steps={steps}", "checkpoint.interval=2"])
    env = train_env()
    metrics = os.path.join(out, "metrics.jsonl")

    def logged() -> list[int]:
        if not os.path.exists(metrics):
            return []
        return [json.loads(x)["step"] for x in open(metrics) if x.strip()]

    with popen_group(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        deadline = time.time() + 400
        while time.time() < deadline and max(logged(), default=0) < 3 and proc.poll() is None:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its engine (it dies with its parent)
        proc.wait(timeout=60)
    killed_after = max(logged())
    assert 3 <= killed_after < steps
    run_train(out, [*DISAGG, "rollout.max_staleness=2", f"train.steps={steps}", "checkpoint.interval=2"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    resumed = 2 if killed_after < 4 else 4  # the checkpoint the second run started from
    first = rows[resumed]  # the first step trained after the resume
    assert first["rollout/staleness_max"] == 0  # pending batches were regenerated from the resumed weights
    assert first["rollout/engine_policy_version"] == resumed
    assert all(r["rollout/staleness_max"] <= 2 for r in rows)
    # one rank, samples up to 2 versions stale, before and after the resume: pi_old recomputed with
    # the generating weights == the engine's log-probs
    assert all(r["rollout/logprob_abs_diff"] < 1e-5 for r in rows), rows


def test_offpolicy_two_ranks_expert_parallel_keeps_the_staleness_bound(tmp_path):
    """Two training ranks (EP2 inside DP2), ``rollout.max_staleness=1``: the staleness schedule and the
    engines' policy version follow the bound; every rank swaps in its own copy of the generating
    weights for the behaviour log-probs, and no rank pauses the engine while rank 0 generates. (One
    rank's off-policy run: test_killed_offpolicy_run_resumes, staleness 2, its log-probs checked too.)"""
    out = str(tmp_path / "run")
    run_train(out, [*DISAGG, "rollout.max_staleness=1", "train.steps=4", "parallel.ep=2"], nproc=2)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        s = r["step"]
        assert r["rollout/staleness_max"] <= 1
        assert r["rollout/staleness_max"] == r["rollout/staleness_mean"] == min(1, s - 1)
        assert r["rollout/engine_policy_version"] == max(0, s - 2)
        for k in ("rollout/trainer_wait_s", "rollout/engine_wait_s", "rollout/sync_wait_s"):
            assert r[k] >= 0.0
        # pi_old recomputed with the weights that generated the samples == the engine's log-probs
        assert r["rollout/logprob_abs_diff"] < 1e-5, r
    # the stale steps really were off-policy: the first mini-batch's ratio moved away from 1
    assert max(abs(r["gspo/ratio_mean"] - 1.0) for r in rows[1:]) > 1e-4
