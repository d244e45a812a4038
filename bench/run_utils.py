"""Shared by the learning benches (bench/family_learning.py, bench/lora_learning.py): one ``gspo-train``
run in a subprocess on the demo's CPU config, its log in a file, its metrics read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(ROOT, "configs", "demo_cpu.yaml")
# every bench run: no progress bar, no TensorBoard, no checkpoints (the benches read metrics.jsonl)
QUIET = ["logging.progress=false", "logging.tensorboard=false", "checkpoint.interval=0"]


def train(out: str, overrides: list[str], config: str = DEMO_CONFIG) -> tuple[list[dict], float]:
    """One gspo-train run (one trainer rank, ``config`` with ``overrides``) writing to ``out``, its
    stdout and stderr in ``out``.log; returns (the rows of its metrics.jsonl, wall seconds). A failed
    run ends the bench (SystemExit naming the log)."""
    cmd = [sys.executable, "-m", "gspo_megatron.train", "--config", config, f"output_dir={out}", *QUIET, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    start = time.time()
    with open(out + ".log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{out}: exit code {code}; log {out}.log")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], time.time() - start


def mean(xs) -> float:
    """The mean of ``xs`` (0 for none)."""
    xs = list(xs)
    return sum(xs) / max(1, len(xs))
