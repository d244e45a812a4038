"""Loading a dist checkpoint reads each stored tensor straight into its parameter
(gspo_megatron/dist_ckpt_in_place.direct_reads: one preadv instead of torch DCP's buffer, torch.load and
copy_), and gives bitwise the same weights as torch DCP's own reader, in the saved layout and resharded
(where a requested region is strided, that item goes through DCP's reader)."""

from __future__ import annotations

import pytest
import torch

from checkpoint_workers import direct_reads_job
from distributed_harness import run_ranks


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    path = str(tmp_path_factory.mktemp("hf") / "hf")
    save_tiny_hf_model("qwen3_moe", path, seed=6, num_hidden_layers=2)
    return path


def _same(r: dict) -> bool:
    return sorted(r["a"]) == sorted(r["b"]) and all(torch.equal(r["a"][k], r["b"][k]) for k in r["b"])


def test_same_layout_reads_every_tensor_directly(hf_dir, tmp_path):
    (r,) = run_ranks(direct_reads_job, 1, hf_dir, str(tmp_path / "ckpt"), 1, 1)
    assert r["readers"] == 1 and r["direct_items"] > 0 and r["base_tensor_items"] == 0, (r["direct_items"], r["base_tensor_items"])
    assert _same(r)


@pytest.mark.parametrize("save_tp,load_tp", [(2, 1), (1, 2)])
def test_resharded_load_equals_dcp_reader(hf_dir, tmp_path, save_tp, load_tp):
    results = run_ranks(direct_reads_job, 2, hf_dir, str(tmp_path / "ckpt"), save_tp, load_tp)
    for r in results:
        # row-parallel weights cut along dim 1 are strided regions: those take DCP's reader
        assert r["direct_items"] > 0 and r["base_tensor_items"] > 0, (r["direct_items"], r["base_tensor_items"])
        assert _same(r)
