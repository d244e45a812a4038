"""GPU tests: the trainer end to end with real SGLang engines (sglang.launch_server), as a user runs it.

Run on a GPU node with sglang installed (the Docker image): ``pytest -m gpu tests/gpu``. Skipped on
CPU (conftest). The same runs on CPU use the CPU stand-in server (tests/topology/test_multinode.py);
here the only change is ``rollout.engine_server=sglang``: CUDA IPC / NCCL transports, SGLang's memory
saver, its weight-update session and its log-probs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(tmp_path, overrides: list[str], nproc: int = 1, timeout_s: float = 1800) -> list[dict]:
    out = tmp_path / "run"
    if nproc == 1:
        cmd = [sys.executable, "-m", "gspo_megatron.train"]
    else:
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "torchrun"),
            "--nproc-per-node",
            str(nproc),
            "-m",
            "gspo_megatron.train",
        ]
    cmd += [
        "--config",
        os.path.join(ROOT, "configs/topology_30b_tiny.yaml"),
        f"output_dir={out}",
        "rollout.engine_server=sglang",
        "model.dtype=bfloat16",
        "rollout.sync_verify=true",
        "rollout.sync_verify_every=1",
        "train.steps=2",
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_colocated_engine_on_one_gpu(tmp_path):
    """One training rank and one SGLang engine sharing the GPU: CUDA IPC sync, memory saver."""
    pytest.importorskip("sglang")
    metrics = _train(
        tmp_path,
        [
            "parallel.tp=1",
            "parallel.ep=1",
            "parallel.sequence_parallel=false",
            "rollout.engine_tp=1",
            "rollout.num_engines=1",
        ],
    )
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["rollout/engines_serving"] == 1
        assert m["sync/verify_max_abs_diff"] <= 0.25  # bf16 engine vs bf16 trainer
        assert m["rollout/logprob_abs_diff"] < 0.1


def test_disaggregated_engine_on_a_second_gpu(tmp_path):
    """One training rank on GPU 0, one engine launched by rank 0 on GPU 1: an NCCL weight-update group."""
    pytest.importorskip("sglang")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks of one group on one device)")
    metrics = _train(
        tmp_path,
        [
            "parallel.tp=1",
            "parallel.ep=1",
            "parallel.sequence_parallel=false",
            "rollout.sync_mode=disaggregated",
            "rollout.engine_tp=1",
            "rollout.num_engines=1",
        ],
    )
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["sync/verify_max_abs_diff"] <= 0.25 for m in metrics)
