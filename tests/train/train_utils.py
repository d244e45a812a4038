"""Helpers for end-to-end training tests: run gspo-train (plain or under torchrun) in a subprocess
and read its metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gspo_megatron.runtime.ports import free_port
from subprocess_utils import run_group

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# A tiny, fast configuration shared by the e2e tests (the demo model, few prompts, few steps).
# one disaggregated CPU-server engine, checked against the trainer after every sync (the runs' usual engine)
CPU_ENGINE_DISAGGREGATED = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
    "rollout.sync_verify=true",
    "rollout.sync_verify_every=1",
]
FAST = [
    "train.steps=3",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=3",
    "parallel.micro_batch_size=4",
    "gspo.mini_batches=2",
    "logging.progress=false",
    "logging.tensorboard=false",
    "checkpoint.interval=0",
    "optimizer.lr=0.003",
]


def torchrun_cmd(nproc: int, *target: str) -> list[str]:
    """The command that runs ``target`` (a script and its arguments, or ``-m`` and a module's) under
    torchrun with ``nproc`` ranks on this machine, on a free rendezvous port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        *target,
    ]


def train_cmd(out_dir: str, overrides: list[str], nproc: int = 1, config: str = "configs/demo_cpu.yaml") -> list[str]:
    """The ``gspo-train`` command of ``config`` with ``overrides`` into ``out_dir`` (torchrun with
    ``nproc`` > 1); run it with ``cwd=REPO`` and :func:`train_env`."""
    args = ["--config", os.path.join(REPO, config), f"output_dir={out_dir}", *overrides]
    if nproc == 1:
        return [sys.executable, "-m", "gspo_megatron.train", *args]
    return torchrun_cmd(nproc, "-m", "gspo_megatron.train", *args)


def train_env() -> dict[str, str]:
    """The environment a training subprocess runs in: this process's as it is now (a test's
    ``monkeypatch.setenv`` included, so it is read at call time, not import time), one thread per rank."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def run_train(
    out_dir: str,
    overrides: list[str],
    nproc: int = 1,
    config: str = "configs/demo_cpu.yaml",
    timeout: int = 600,
    check: bool = True,
) -> subprocess.CompletedProcess:
    cmd = train_cmd(out_dir, [*FAST, *overrides], nproc, config)
    proc = run_group(cmd, timeout=timeout, cwd=REPO, env=train_env())  # kills torchrun's ranks / engine children too
    if check and proc.returncode != 0:
        raise AssertionError(f"gspo-train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_demo_tokenized_checkpoint(out_dir: str, family: str, seed: int = 0, **overrides) -> str:
    """``family``'s tiny model written by transformers' ``save_pretrained`` into ``out_dir`` (as a user
    downloads a checkpoint) plus the byte-level demo tokenizer; the vocabulary is 320 rows so the
    tokenizer's 259 ids fit (overrides may change it). Returns ``out_dir``."""
    from gspo_megatron.data.tokenizer import build_demo_tokenizer
    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model(family, out_dir, seed=seed, **{"vocab_size": 320, **overrides})
    build_demo_tokenizer(out_dir)
    return out_dir


def score_checkpoint(checkpoint: str, rows: list[list[int]], work_dir: str, timeout: int = 300) -> list[list[float]]:
    """Per-token log-probs of ``rows`` (row i: len(rows[i]) - 1 floats) under a Megatron checkpoint (a
    run's ``checkpoints/`` root or step directory) or an HF directory, through ``tools/score.py`` in one
    process (the checkpoint resharded to one rank); its input / output JSONL go to ``work_dir``."""
    os.makedirs(work_dir, exist_ok=True)
    src, dst = os.path.join(work_dir, "rows.jsonl"), os.path.join(work_dir, "logprobs.jsonl")
    with open(src, "w") as f:
        f.writelines(json.dumps({"input_ids": r}) + "\n" for r in rows)
    cmd = [sys.executable, os.path.join(REPO, "tools", "score.py"), "--checkpoint", checkpoint]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = run_group([*cmd, "--input", src, "--output", dst], timeout=timeout, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise AssertionError(f"tools/score.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(dst) as f:
        return [json.loads(line)["logprobs"] for line in f]


def run_sync_check(
    out_dir: str,
    overrides: list[str],
    script: str,
    nproc: int = 1,
    config: str = "configs/demo_cpu.yaml",
    timeout: int = 900,
) -> tuple[list[dict], list[dict]]:
    """gspo-train through a sync-checking launcher ``script`` (tests/topology/sync_check.py or one built on
    it) under torchrun with ``nproc`` ranks, ``config`` with FAST and ``overrides``: after every sync the
    engines' weights are compared with the trainer's HF export, one JSON line per sync in the file
    ``GSPO_SYNC_CHECK_FILE`` names (``out_dir``'s sibling ``<out_dir>_checks.jsonl``). Returns (the
    run's metrics rows, the check lines); a failed run raises AssertionError with its output's tail."""
    checks = f"{out_dir}_checks.jsonl"
    cmd = torchrun_cmd(
        nproc, script, "--config", os.path.join(REPO, config), f"output_dir={out_dir}", *FAST, *overrides
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GSPO_SYNC_CHECK_FILE=checks)
    proc = run_group(cmd, timeout=timeout, cwd=REPO, env=env)  # kills torchrun's ranks / engine children too
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    with open(checks) as f:
        return read_metrics(out_dir), [json.loads(line) for line in f]
