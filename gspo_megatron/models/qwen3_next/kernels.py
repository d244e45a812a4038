"""Gated DeltaNet kernels: the chunked gated delta rule and the causal short convolution, in torch
(CPU, and any device without flash-linear-attention), with exact resets at packed-sequence boundaries.

The gated delta rule (Yang et al. 2024), per value head, with a state S_t [d_k, d_v] starting at zero
at the first token of every sequence:

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - exp(g_t) * S_{t-1}^T k_t))^T
    o_t = S_t^T (q_t / sqrt(d_k))

(q_t, k_t L2-normalized [d_k]; v_t [d_v]; g_t <= 0 the log decay; beta_t in (0, 1) the write strength).
``recurrent_gated_delta_rule`` runs it token by token (the reference; transformers'
``torch_recurrent_gated_delta_rule``, the engines' decode path). ``chunk_gated_delta_rule`` computes the
same in chunks of C tokens (the WY form of flash-linear-attention and transformers'
``torch_chunk_gated_delta_rule``): within a chunk, with G = cumsum(g) and D_ij = exp(G_i - G_j) (i >= j),

    T = (I + tril_{-1}((beta k) k^T * D))^{-1}        # [C, C], a unit lower-triangular solve
    U = T (beta v),   W = T (beta k * exp(G))          # the chunk's pseudo-values / decayed keys
    V' = U - W S                                        # what the chunk writes, given the entry state S
    O = (q * exp(G)) S + tril((q k^T) * D) V'
    S <- exp(G_C) S + (k * exp(G_C - G))^T V'

``causal_conv1d``: a depthwise convolution of kernel K over time, zero history before each sequence's
first token (y_t = sum_{j<K} w_{j} x_{t-K+1+j}), then SiLU (Qwen3-Next's ``linear_attn.conv1d``).

Packed rows (THD, ``cu_seqlens`` [n+1] offsets into the token dimension of a batch of one row): each
segment runs alone, from a zero state and a zero convolution history, so no value crosses a boundary.
On CUDA with flash-linear-attention installed, ``chunk_gated_delta_rule`` calls fla's Triton kernel
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, which takes ``cu_seqlens`` itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (transformers' and fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def segments(cu_seqlens, total: int) -> list[tuple[int, int]]:
    """[(start, end)] of the non-empty segments; the whole row when ``cu_seqlens`` is None."""
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if cu[0] != 0 or cu[-1] != total:
        raise ValueError(f"cu_seqlens span {cu[0]}..{cu[-1]} but the packed row has {total} tokens")
    return [(a, b) for a, b in zip(cu[:-1], cu[1:]) if b > a]


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, cu_seqlens=None, activation: bool = True
) -> torch.Tensor:
    """x [B, D, T], weight [D, K] (depthwise), bias [D] or None -> SiLU(conv) [B, D, T]; with
    ``cu_seqlens`` (B == 1) each segment is convolved alone (zero history at its first token)."""
    d, k = weight.shape
    w = weight.unsqueeze(1).to(x.dtype)

    def conv(seg):
        return F.conv1d(seg, w, bias, padding=k - 1, groups=d)[..., : seg.shape[-1]]

    spans = segments(cu_seqlens, x.shape[-1])
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"packed rows (cu_seqlens) need a batch of 1, got {x.shape[0]}")
    y = (
        conv(x)
        if len(spans) == 1 and spans[0] == (0, x.shape[-1])
        else torch.cat([conv(x[..., a:b]) for a, b in spans], dim=-1)
    )
    if y.shape[-1] != x.shape[-1]:  # empty segments only at the ends: keep the row's length
        y = F.pad(y, (0, x.shape[-1] - y.shape[-1]))
    return F.silu(y) if activation else y


def _chunked(q, k, v, g, beta, chunk: int):
    """One sequence (per batch row and head), fp32: q, k [B, H, L, dk] (normalized and scaled),
    v [B, H, L, dv], g, beta [B, H, L] -> o [B, H, L, dv]. The module docstring's WY recursion."""
    b, h, n, dk = k.shape
    dv = v.shape[-1]
    pad = (-n) % chunk
    if pad:  # zero rows: beta = 0 writes nothing, g = 0 decays nothing; cut off again below
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    m = (n + pad) // chunk
    q, k, v = (t.reshape(b, h, m, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(b, h, m, chunk).cumsum(-1), beta.reshape(b, h, m, chunk)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # D_ij, i >= j
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    a = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    t = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    u, w = t @ v_beta, t @ (k_beta * g.exp().unsqueeze(-1))
    state = q.new_zeros(b, h, dk, dv)
    outs = []
    for i in range(m):
        qi, ki, gi = q[:, :, i], k[:, :, i], g[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ state
        attn = (qi @ ki.transpose(-1, -2)) * decay[:, :, i]
        outs.append((qi * gi.exp().unsqueeze(-1)) @ state + attn @ v_new)
        last = gi[..., -1:]
        state = state * last.exp().unsqueeze(-1) + (ki * (last - gi).exp().unsqueeze(-1)).transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2).reshape(b, h, m * chunk, dv)[:, :, :n]


def torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, chunk_size: int = 64) -> torch.Tensor:
    """q, k [B, T, H, dk] (L2-normalized, heads already repeated to the value heads), v [B, T, H, dv],
    g (log decay), beta [B, T, H] -> o [B, T, H, dv] in q's dtype (computed in fp32); with
    ``cu_seqlens`` (B == 1) every segment starts from a zero state."""
    dtype = q.dtype
    scale = q.shape[-1] ** -0.5
    q, k, v, g, beta = (t.transpose(1, 2).to(torch.float32) for t in (q, k, v, g, beta))
    q = q * scale
    spans = segments(cu_seqlens, q.shape[2])
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"packed rows (cu_seqlens) need a batch of 1, got {q.shape[0]}")
    outs = [
        _chunked(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], g[:, :, a:e], beta[:, :, a:e], chunk_size) for a, e in spans
    ]
    out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    if out.shape[2] != q.shape[2]:
        out = F.pad(out, (0, 0, 0, q.shape[2] - out.shape[2]))
    return out.transpose(1, 2).contiguous().to(dtype)


def recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None) -> torch.Tensor:
    """The token-by-token recurrence of the module docstring (the reference); same shapes as
    ``torch_chunk_gated_delta_rule``. The state is zeroed at every ``cu_seqlens`` boundary."""
    dtype = q.dtype
    q, k, v, g, beta = (t.transpose(1, 2).to(torch.float32) for t in (q, k, v, g, beta))
    q = q * q.shape[-1] ** -0.5
    b, h, n, dk = k.shape
    starts = {a for a, _ in segments(cu_seqlens, n)}
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = []
    for t in range(n):
        if t in starts:
            state = torch.zeros_like(state)
        state = state * g[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (state * k[:, :, t, :, None]).sum(-2)) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(out, dim=2).transpose(1, 2).contiguous().to(dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None) -> torch.Tensor:
    """The kernel the module calls: fla's Triton kernel on CUDA when flash-linear-attention imports,
    ``torch_chunk_gated_delta_rule`` otherwise. Shapes as ``torch_chunk_gated_delta_rule``."""
    if q.is_cuda:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        except ImportError:
            fla_chunk = None
        if fla_chunk is not None:
            cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens, dtype=torch.long, device=q.device)
            out, _ = fla_chunk(
                q,
                k,
                v,
                g=g,
                beta=beta,
                initial_state=None,
                output_final_state=False,
                cu_seqlens=cu,
                use_qk_l2norm_in_kernel=False,
            )
            return out
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)
