"""Optional blockwise FP8 quantize-on-sync, in the layout of DeepSeek-V3 / Qwen3-FP8 HF checkpoints.

A linear weight ``W [out, in]`` is cut into 128 x 128 blocks (the last row/column blocks may be
smaller). Per block ``b``: ``scale_inv[b] = amax(|W_b|) / 448`` (448 = largest finite e4m3 value)
and ``Q_b = cast_e4m3(W_b / scale_inv[b])``. The engine dequantizes as ``W_b ~= Q_b * scale_inv[b]``.
Names: ``<module>.weight`` carries ``Q`` (torch.float8_e4m3fn, [out, in]) and
``<module>.weight_scale_inv`` carries the scales (float32, [ceil(out/128), ceil(in/128)]).

Only the big projections are quantized, as in the published FP8 checkpoints; which ones is each model
family's rule (``ModelFamily.fp8_modules`` / ``fp8_excluded`` in ``gspo_megatron/models``): attention
and MLP / expert projections are, norms, embeddings, routers, gates and lm_head are not. Pure torch:
runs on CPU (float8_e4m3fn casts work there). The engine must be launched from an FP8 checkpoint
config so that its loader has parameters for these names:
``engines.engine_model.prepare_engine_model_dir`` writes it (``quant_method: fp8``,
``weight_block_size: [128, 128]``, ``activation_scheme: dynamic``). The names and scale shapes are
those sglang 0.5.23 creates for block FP8 (``Fp8LinearMethod`` / ``Fp8MoEMethod``; checked in
tests/rollout/test_engine_model.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from gspo_megatron.wire_format import FP8_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = FP8_BLOCK
SCALE_SUFFIX = "_scale_inv"


def is_fp8_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """True for 2-D floating weights that a model family quantizes on sync (see module docstring)."""
    from gspo_megatron.models.registry import fp8_quantizes

    return tensor.dim() == 2 and tensor.is_floating_point() and tensor.dtype != FP8_DTYPE and fp8_quantizes(name)


def _check_2d(w: torch.Tensor, what: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")


def quantize_blockwise_fp8(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [M, N]`` -> ``(q [M, N] float8_e4m3fn, scale_inv [ceil(M/b), ceil(N/b)] float32)``.

    All-zero blocks get ``scale_inv = 1`` (any positive value dequantizes them to zero exactly).
    """
    _check_2d(weight, "quantize_blockwise_fp8")
    if block <= 0:
        raise ValueError(f"quantize_blockwise_fp8: block must be positive, got {block}")
    m, n = weight.shape
    mb, nb = -(-m // block), -(-n // block)
    w = weight.float()
    # Zero padding to whole blocks does not change any block's amax.
    padded = F.pad(w, (0, nb * block - n, 0, mb * block - m))
    blocks = padded.view(mb, block, nb, block)
    amax = blocks.abs().amax(dim=(1, 3))  # [mb, nb]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(mb * block, nb * block)[:m, :n].to(FP8_DTYPE)
    return q.contiguous(), scale_inv.contiguous()


def dequantize_blockwise_fp8(
    q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise_fp8`: ``q [M, N]`` * per-block ``scale_inv`` -> ``dtype``."""
    _check_2d(q, "dequantize_blockwise_fp8")
    m, n = q.shape
    mb, nb = -(-m // block), -(-n // block)
    if tuple(scale_inv.shape) != (mb, nb):
        raise ValueError(
            f"dequantize_blockwise_fp8: scale_inv shape {tuple(scale_inv.shape)} does not match "
            f"weight {tuple(q.shape)} with block {block} (expected {(mb, nb)})"
        )
    scale = scale_inv.float().repeat_interleave(block, 0)[:m].repeat_interleave(block, 1)[:, :n]
    return (q.float() * scale).to(dtype)


def quantize_bucket_fp8(
    bucket: Sequence[tuple[str, torch.Tensor]],
    *,
    block: int = BLOCK,
    predicate: Callable[[str, torch.Tensor], bool] = is_fp8_quantizable,
) -> list[tuple[str, torch.Tensor]]:
    """Replace each quantizable ``(name, W)`` by ``(name, Q)`` and ``(name + "_scale_inv", S)``;
    other tensors pass through unchanged, order kept. Tensors stay on their device."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in bucket:
        if predicate(name, tensor):
            q, s = quantize_blockwise_fp8(tensor, block)
            out.append((name, q))
            out.append((name + SCALE_SUFFIX, s))
        else:
            out.append((name, tensor))
    return out
