"""Faults during a run (issue: reliability): a killed rollout engine, a killed reward worker, a
killed trainer (kill -9, then the same command resumes), and SIGTERM preemption."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench"))

import fault_injection  # noqa: E402
from subprocess_utils import popen_group, run_group  # noqa: E402


@pytest.mark.parametrize("kind", ["engine", "trainer", "reward"])
def test_fault_is_recovered_without_data_loss(kind, tmp_path):
    with open(tmp_path / "log.txt", "w") as log:
        result = fault_injection.trial(kind, random.Random(1), nproc=1, log=log, out_dir=str(tmp_path / "run"))
    logtext = (tmp_path / "log.txt").read_text()
    assert result["injected"], logtext[-4000:]
    assert result["recovered"], (result, logtext[-4000:])
    assert not result["data_lost"]
    assert result["orphans"] == []  # nothing of the run outlived it (after a trainer kill neither)
    if kind == "engine":
        rows = [json.loads(x) for x in open(os.path.join(result["out_dir"], "metrics.jsonl"))]
        assert rows[-1]["rollout/engine_restarts"] >= 1
        assert "rollout engine died" in logtext
    if kind == "trainer":
        assert result["first_exit"] != 0 and result["final_exit"] == 0
        assert result["steps_lost"] <= 2  # at most the finished steps since the last checkpoint (interval 2)


def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    out = str(tmp_path / "run")
    cmd = fault_injection.command(out, 1)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with popen_group(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        deadline = time.time() + 300
        while time.time() < deadline and not fault_injection.metrics_steps(out):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, text[-3000:]
    assert "signal received: checkpointed step" in text
    stopped_at = max(fault_injection.metrics_steps(out))
    assert fault_injection.latest_step(out) == stopped_at < fault_injection.STEPS
    rerun = run_group(cmd, timeout=600, cwd=REPO, env=env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert fault_injection.metrics_steps(out) == list(range(1, fault_injection.STEPS + 1))
