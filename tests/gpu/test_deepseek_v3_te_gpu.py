"""GPU test: DeepSeek-V3 (multi-latent attention, sigmoid router with correction bias, shared expert,
a dense first layer, YaRN) built on Transformer Engine's layer spec (TELinear "duplicated" down
projections, q / kv norms fused into TELayerNormColumnParallelLinear, TEGroupedMLP experts) gives
transformers' per-token log-probs within 1e-4 in fp32, in one rank and in tp2 when two GPUs are
there; so do DeepSeek-V3.2 and GLM-5 (with "shared" indexer layers) on the same TE linears with our
DSA core attention, which normalizes MLA's ``qr`` with the fused q norm's weight. The DSA reference
runs transformers on the GPU too (the indexer's top-k tie order is the device's:
deepseek_v32/indexer.py). The CPU tests (tests/models/test_deepseek_v3_te.py, test_dsa_te.py) check
the same models' names, shapes and HF round trip through a TE stand-in, and DSA's forward through the
stand-in's plain-torch TE modules; this one runs TE's own forward."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

MODELS = {
    "deepseek_v3": {},
    "deepseek_v32": {},
    "glm_moe_dsa": {"indexer_types": ["full", "shared", "full", "shared"]},
}


def _hf_logprobs_on(model, rows: list[list[int]], device: str) -> list[list[float]]:
    """hf_reference.hf_logprobs with the model and each row on ``device``."""
    model = model.float().to(device).eval()
    out = []
    with torch.no_grad():
        for ids in rows:
            t = torch.tensor([ids], device=device)
            logits = model(t).logits[0].float()
            out.append(torch.log_softmax(logits[:-1], -1).gather(1, t[0, 1:, None]).squeeze(1).tolist())
    return out


@pytest.mark.parametrize("model_type", list(MODELS))
@pytest.mark.parametrize("tp", [1, 2])
def test_te_mla_logprobs_equal_transformers(tmp_path, tp, model_type):
    pytest.importorskip("transformer_engine")
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    from distributed_harness import run_ranks
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from hf_reference import make_rows, max_abs_diff
    from te_mla_workers import te_logprobs

    model = save_tiny_hf_model(model_type, str(tmp_path / "hf"), seed=7, **MODELS[model_type])
    rows = make_rows(seed=2, n=7, vocab=256, max_len=23)
    ref = _hf_logprobs_on(model, rows, "cpu" if model_type == "deepseek_v3" else "cuda")
    got = run_ranks(te_logprobs, tp, str(tmp_path / "hf"), rows, tp)[0]
    assert max_abs_diff(got, ref) < 1e-4
