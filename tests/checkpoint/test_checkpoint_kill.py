"""kill -9 during a save loop leaves the newest complete checkpoint loadable, and no process of
the killed saver alive (it writes in-process; with Megatron's own writer that would be its Manager,
forked writers and resource tracker)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid

from distributed_harness import run_ranks

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import fault_injection  # noqa: E402


def load_latest(rank, world, hf_dir, root):
    import torch

    from gspo_megatron.checkpoint import manager as ck
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    init_distributed(ParallelLayout())
    model = build_model(load_hf_config(hf_dir), opts=ModelOptions(perform_initialization=False))
    step, extra = ck.load_checkpoint(root, model)
    values = torch.cat([p.detach().flatten() for p in model.parameters()]).unique().tolist()
    return step, extra, values


def test_kill_during_save_loop_leaves_a_loadable_checkpoint(tmp_path):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    hf_dir, root = str(tmp_path / "hf"), str(tmp_path / "run")
    save_tiny_hf_model("qwen3_moe", hf_dir, num_hidden_layers=2)
    marker = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=ROOT, GSPO_TEST_MARKER=marker)
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "save_loop_script.py"), hf_dir, root],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        for line in proc.stdout:
            if line.startswith("saved 2"):
                break
        time.sleep(random.Random(0).uniform(0.05, 0.6))  # somewhere inside a later save
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline, alive = time.time() + 20, fault_injection.marked_processes("GSPO_TEST_MARKER", marker)
        while alive and time.time() < deadline:
            time.sleep(0.1)
            alive = fault_injection.marked_processes("GSPO_TEST_MARKER", marker)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        fault_injection.kill_marked("GSPO_TEST_MARKER", marker)
    assert alive == [], {p: fault_injection.cmdline(p) for p in alive}  # nothing outlived the saver
    ((step, extra, values),) = run_ranks(load_latest, 1, hf_dir, root)
    assert step >= 2 and extra == {"step": step}
    assert values == [float(step)]  # every weight comes from that one save
