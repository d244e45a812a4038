"""GPU test: a checkpoint of CUDA parameters written by gspo_megatron/checkpoint/writer.py (tensors
staged to host memory by Megatron's own ``preload_tensors``, then written by the saving process) is
the checkpoint Megatron's writer makes: same files, same items at the same offsets, and bitwise the
same parameters back through the direct reader and torch DCP's reader. The CPU version of the same
comparison is tests/checkpoint/test_direct_writes.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_cuda_parameters_saved_in_process_as_megatrons_writer_saves_them(tmp_path):
    from checkpoint_workers import direct_writes_job
    from distributed_harness import run_ranks
    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model("qwen3_moe", str(tmp_path / "hf"), seed=8, num_hidden_layers=2)
    (r,) = run_ranks(direct_writes_job, 1, str(tmp_path / "hf"), str(tmp_path / "ckpts"), 1)
    assert next(iter(r["original"].values())).is_cuda
    assert r["direct_files"] == r["mcore_files"] and r["direct_layout"] == r["mcore_layout"]
    assert r["direct_forks"] == 0 and not r["direct_manager"]
    for name in ("direct_read_direct", "direct_read_dcp", "mcore_read_direct", "mcore_read_dcp"):
        assert sorted(r[name]) == sorted(r["original"])
        assert all(torch.equal(r["original"][k], r[name][k]) for k in r["original"]), name
