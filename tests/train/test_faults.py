"""Faults during a run (issue: reliability): a killed rollout engine, a killed reward worker, a
killed trainer (kill -9, then the same command resumes), and SIGTERM preemption."""

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid

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


CPU_ENGINE = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "logging.progress=false",
    "logging.tensorboard=false",
]
ENGINES_OF = {
    "colocated": ["rollout.sync_mode=colocated"],
    "disaggregated": ["rollout.sync_mode=disaggregated", "rollout.num_engines=1"],
}
COLOCATED_CPU_ENGINE = [*CPU_ENGINE, *ENGINES_OF["colocated"]]


def _stop_while_engines_start(tmp_path, cmd: list[str]) -> tuple[str, int, list[int], str]:
    """Start ``cmd``, and as soon as the trainer says an engine is starting (the CPU server needs
    seconds to import torch and build its model) send SIGTERM to its first process (the trainer, or
    torchrun's agent, which passes it to its ranks). Returns (output, exit status,
    processes of the run still alive 20 s later, the run dir)."""
    out = str(tmp_path / "run")
    marker = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{fault_injection.MARK: marker})
    cmd = [*cmd, f"output_dir={out}"]
    try:
        with popen_group(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
            lines = []
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if "starting; log" in line:
                    break
            assert lines and "starting; log" in lines[-1], "".join(lines)[-3000:]
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest, _ = proc.communicate(timeout=120)
            took = time.monotonic() - t0
        left = fault_injection.leftovers(marker)
    finally:
        fault_injection.kill_marked(fault_injection.MARK, marker)
    text = "".join(lines) + rest
    assert took < 60, (took, text[-3000:])  # not rollout.engine_launch_timeout_s (600 s)
    return text, proc.returncode, left, out


@pytest.mark.parametrize("sync", ["colocated", "disaggregated"])
def test_sigterm_while_an_engine_starts_stops_it_and_exits(tmp_path, sync):
    """SIGTERM while the CPU-server engine is still starting (colocated: while the trainer waits for
    it; disaggregated: launched before the model build, so the signal arrives while the trainer builds
    and loads its model, and is acted on when it comes to wait): the trainer kills the engine it
    launched, closes what it opened and exits 0 with one line, no traceback; no process of the run
    survives; what was already written (config.yaml) stays."""
    cmd = [sys.executable, "-m", "gspo_megatron.train", "--config", os.path.join(REPO, "configs/demo_cpu.yaml")]
    text, code, left, out = _stop_while_engines_start(tmp_path, [*cmd, *CPU_ENGINE, *ENGINES_OF[sync]])
    assert code == 0, text[-3000:]
    assert "SIGTERM received while waiting for SGLang server" in text and "engines stopped, exiting" in text, text
    assert "Traceback" not in text, text[-3000:]
    assert left == [], left
    assert os.path.isfile(os.path.join(out, "config.yaml"))
    assert not os.path.exists(os.path.join(out, "checkpoints")) or not os.listdir(os.path.join(out, "checkpoints"))


def test_sigterm_to_torchrun_while_colocated_engines_start_stops_every_rank(tmp_path):
    """Two ranks, one colocated engine each (each rank launches its own): torchrun passes SIGTERM to
    both; every rank learns the stop through the fleet's collective, kills its engine and exits;
    rank 0 prints the line; nothing of the run survives."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={fault_injection.free_port()}",
        "-m",
        "gspo_megatron.train",
        "--config",
        os.path.join(REPO, "configs/demo_cpu.yaml"),
        "parallel.ep=2",
        "parallel.micro_batch_size=4",
        *COLOCATED_CPU_ENGINE,
    ]
    text, _, left, _ = _stop_while_engines_start(tmp_path, cmd)
    assert "SIGTERM received while waiting for SGLang server" in text and "engines stopped, exiting" in text, text
    assert left == [], left
