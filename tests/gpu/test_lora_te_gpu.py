"""GPU test: LoRA on Transformer Engine's own modules (``model.transformer_impl=transformer_engine``,
models/lora_te.py: the fused-norm linears hand the adapter TE's normalized input, the grouped expert
GEMM carries one adapter per expert) against LoRA on the local spec, on the GPU, for the Qwen3-MoE
and DeepSeek-V3 tiny models in fp32: the same adapters (A seeded by the spec-independent name, B set
alike) give the same log-probs, the same merged HF export, the same first-step gradients and the same
trained model, within TE's kernel rounding. tests/models/test_lora_te.py checks the same on CPU
through the TE stand-in, with tp2 and ep2."""

from __future__ import annotations

import os
import sys

import pytest

pytestmark = pytest.mark.gpu
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_lora_on_te_equals_lora_on_local(tmp_path, kind):
    pytest.importorskip("transformer_engine")
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from distributed_harness import run_ranks
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from hf_reference import make_rows, max_abs_diff
    from lora_te_workers import lora_spec_layouts
    from test_family_training_parity import assert_same_gradients
    from test_lora import OVERRIDES
    from test_uneven_expert_layouts import make_records

    hf_dir = str(tmp_path / "hf")
    save_tiny_hf_model(kind, hf_dir, seed=11)
    runs = [("local", {}), ("transformer_engine", {})]
    jobs = [(kind, hf_dir, runs)]
    res = run_ranks(lora_spec_layouts, 1, jobs, make_rows(seed=4, n=4), make_records(), OVERRIDES, False)[0][kind]
    local, te = res["local-tp1"], res["te-tp1"]
    assert set(te["grads"]) == set(local["grads"])
    assert max_abs_diff(te["fresh"], te["base"]) < 1e-4
    assert max_abs_diff(te["b"], local["b"]) < 1e-4
    assert max_abs_diff(te["b"], te["base"]) > 1e-3
    assert_same_gradients(te["grads"], local["grads"])
    assert max_abs_diff(te["trained"], local["trained"]) < 1e-3
    worst = max(
        float((te["trained_export"][k] - local["trained_export"][k]).abs().max()) for k in local["trained_export"]
    )
    assert worst < 1e-4
