"""GPU test: sequence packing through Transformer Engine's THD attention (Megatron-Core's
PackedSeqParams with cu_seqlens) gives the padded result: per-token log-probs, loss and gradients,
one GPU, bf16 (TE's THD kernels are fp16/bf16 ones), with bf16-level tolerances. The CPU tests
(tests/pipeline/test_packing.py) check the same code in fp32 within 1e-5 on the local spec."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pipeline"))


def test_te_thd_packed_equals_padded(tmp_path):
    pytest.importorskip("transformer_engine")
    from distributed_harness import run_ranks
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from packing_workers import make_records, packed_vs_padded

    save_tiny_hf_model("qwen3_moe", str(tmp_path / "hf"), seed=5)
    (res,) = run_ranks(packed_vs_padded, 1, [dict()], str(tmp_path / "hf"), 64, 4, "transformer_engine", "bfloat16")
    e = res[0]
    assert e["finite"] and e["grad_max"] > 0
    assert e["grad_diff"] <= 0.05 * e["grad_max"]
    assert e["packed"]["loss"] == pytest.approx(e["padded"]["loss"], rel=2e-2, abs=1e-3)
    n = len(make_records())
    for sid in range(n):
        a = torch.tensor(e["padded"]["logprobs"][sid])
        b = torch.tensor(e["packed"]["logprobs"][sid])
        assert a.shape == b.shape
        assert (a - b).abs().max() < 0.1, sid  # attention across a boundary moves log-probs by ~1
