"""Blockwise FP8 quantize-on-sync against an independent per-block loop reference."""

import math

import pytest
import torch

from gspo_megatron.weight_sync.fp8_quant import (
    FP8_DTYPE,
    dequantize_blockwise_fp8,
    is_fp8_quantizable,
    quantize_blockwise_fp8,
    quantize_bucket_fp8,
)


def _reference(w: torch.Tensor, block: int):
    """Explicit loop over blocks: scale = amax/448, q = e4m3(w/scale)."""
    m, n = w.shape
    w = w.float()
    deq = torch.empty(m, n)
    scales = torch.empty(math.ceil(m / block), math.ceil(n / block))
    for bi, r in enumerate(range(0, m, block)):
        for bj, c in enumerate(range(0, n, block)):
            blk = w[r : r + block, c : c + block]
            amax = blk.abs().max().item()
            s = amax / 448.0 if amax > 0 else 1.0
            s = torch.tensor(s, dtype=torch.float32)
            scales[bi, bj] = s
            deq[r : r + block, c : c + block] = (blk / s).clamp(-448, 448).to(FP8_DTYPE).float() * s
    return deq, scales


@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (127, 129), (300, 7), (5, 260), (256, 384)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_and_error_bound(shape, dtype):
    g = torch.Generator().manual_seed(hash(shape) % 1000)
    w = (torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[1])).to(dtype)
    q, s = quantize_blockwise_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    deq = dequantize_blockwise_fp8(q, s)
    ref_deq, ref_s = _reference(w, 128)
    torch.testing.assert_close(s, ref_s, rtol=0, atol=0)
    torch.testing.assert_close(deq, ref_deq, rtol=0, atol=0)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal spacing 2^-9 in
    # scaled units -> absolute error <= 2^-10 * scale.
    scale_full = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    bound = torch.maximum(w.float().abs() / 16, scale_full * 2.0**-10) * 1.0001
    assert bool(((deq - w.float()).abs() <= bound).all())
    # the block maximum is represented exactly (448 is an e4m3 value)
    assert torch.allclose(deq.abs().amax(), w.float().abs().amax(), rtol=1e-6)


def test_zero_block_and_small_block_size():
    w = torch.zeros(130, 70)
    w[129, 69] = 3.0
    q, s = quantize_blockwise_fp8(w)
    assert s[0, 0] == 1.0  # all-zero block
    deq = dequantize_blockwise_fp8(q, s)
    assert deq[129, 69] == 3.0 and deq.abs().sum() == 3.0
    w2 = torch.randn(10, 9)
    q2, s2 = quantize_blockwise_fp8(w2, block=4)
    assert s2.shape == (3, 3)
    torch.testing.assert_close(dequantize_blockwise_fp8(q2, s2, block=4), _reference(w2, 4)[0], rtol=0, atol=0)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise_fp8(torch.randn(4))
    q, s = quantize_blockwise_fp8(torch.randn(200, 10))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_blockwise_fp8(q, s[:1])


def test_selection_of_linear_weights():
    w = torch.randn(8, 8)
    yes = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.shared_expert.up_proj.weight",
    ]
    no = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.mlp.gate.weight",  # MoE router
        "model.layers.1.mlp.shared_expert_gate.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ]
    assert all(is_fp8_quantizable(n, w) for n in yes)
    assert not any(is_fp8_quantizable(n, w) for n in no)
    assert not is_fp8_quantizable(yes[0], torch.randn(8))  # not 2-D


def test_quantize_bucket_names_and_passthrough():
    norm = torch.randn(16)
    proj = torch.randn(16, 16, dtype=torch.bfloat16)
    bucket = [("model.norm.weight", norm), ("model.layers.0.mlp.down_proj.weight", proj)]
    out = quantize_bucket_fp8(bucket)
    assert [n for n, _ in out] == [
        "model.norm.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.mlp.down_proj.weight_scale_inv",
    ]
    assert out[0][1] is norm
    assert out[1][1].dtype == FP8_DTYPE and out[2][1].shape == (1, 1)
    torch.testing.assert_close(dequantize_blockwise_fp8(out[1][1], out[2][1]), _reference(proj, 128)[0], rtol=0, atol=0)
