"""Log-probs and entropy of target tokens straight from hidden states and the vocab-parallel output
weight: the output layer fused with the softmax statistics, chunked over tokens, so that no
[N, V/tp] logits tensor (nor its gradient) ever exists; only one chunk's [c, V/tp] at a time.

Every tensor-parallel rank calls :func:`fused_vocab_parallel_logprobs` with the same hidden states
[N, H] (the full sequence: after sequence-parallel gather), its shard of the output weight
[V/tp, H] (rank r holds rows [r * V/tp, (r + 1) * V/tp): Megatron's ColumnParallelLinear layout, also
the tied embedding's), and the same targets [N] (or [N, K]: K targets per token in the same pass,
e.g. a teacher's top-k ids; z_y below is then one column per target). Forward, per chunk of c tokens:

    z = (h @ W_r^T).float() / temperature                  [c, V/tp], the GEMM in the weight's dtype
    m_r = max_v z,  S_r = sum_v exp(z - m_r),  E_r = sum_v exp(z - m_r) * (z - m_r),  z_y (if local)

then, once for all N tokens (two collectives: a max, then the three sums in one):

    m = allreduce_max(m_r),  a_r = exp(m_r - m)
    S = allreduce_sum(a_r S_r),   E = allreduce_sum(a_r (E_r + (m_r - m) S_r)),   zy = allreduce_sum(z_y - m)
    logp = zy - log S,   entropy = log S - E / S

Backward recomputes each chunk's logits from the saved h, W and the [N] statistics (no collective):

    p = exp(z - m - log S),   dlogp/dz = 1[v = y] - p,   dH/dz = -p (log p + H),   dz/dlogits = 1/T
    grad_h[chunk] = g @ W_r   (this rank's partial: the caller's Megatron region op sums it over TP)
    grad_W_r     += g^T @ h   (accumulated in fp32, cast to W's dtype at the end)

The elementwise work of each chunk (the statistics above; p and the gradient below) is
:mod:`gspo_megatron.losses.chunk_kernels`: eager in place, or compiled by torch.compile into a few
fused kernels (the default on a GPU with Triton): the same fp32 math over the GEMM's output.

Memory: one [c, V/tp] fp32 chunk (plus its GEMM output in the weight's dtype) in forward and backward,
the [N] statistics, and in backward one fp32 [V/tp, H] accumulator for grad_W (param-sized, not T-sized)
and grad_h [N, H]. Nothing scales with N x V.

Gradient of the hidden states: like ColumnParallelLinear's input gradient, each TP rank's grad_h is the
contribution of its vocab shard only; the caller must route h through Megatron's
``copy_to_tensor_model_parallel_region`` (or, with sequence parallelism,
``gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=True)``) whose backward sums
(reduce-scatters) it over the TP group -- exactly what the output layer itself does.
:func:`gspo_megatron.models.lm_head.lm_hidden_states` does that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_megatron.losses.chunk_kernels import ChunkOps, Kernels, chunk_ops
from gspo_megatron.losses.chunking import chunk_tokens, local_targets
from gspo_megatron.losses.reductions import group_rank, group_size


class _FusedVocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        tp_group,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        vocab_size: int | None,
        ops: ChunkOps,
    ):
        n = hidden.shape[0]
        vocab_local = weight.shape[0]
        vocab_start = group_rank(tp_group) * vocab_local
        multi = group_size(tp_group) > 1
        cdt = torch.promote_types(weight.dtype, torch.float32)  # fp32 softmax math (fp64 stays fp64)
        if vocab_size is None:
            vocab_size = vocab_local * group_size(tp_group)
        valid_cols = max(0, min(vocab_local, vocab_size - vocab_start))  # Megatron's vocab padding left out
        w = weight[:valid_cols]
        col, in_shard = local_targets(targets, vocab_start, valid_cols)

        dev = hidden.device
        k = targets.shape[1]
        m_loc = torch.full((n,), -torch.inf, dtype=cdt, device=dev)
        stats = torch.zeros(2 + k, n, dtype=cdt, device=dev)  # S_r, E_r, z_y1 .. z_yK (local, unshifted)
        for lo in range(0, n if valid_cols else 0, chunk):
            hi = min(lo + chunk, n)
            mr, sr, er, zy = ops.stats(  # the chunk's GEMM output [c, V/tp] is passed on, not kept
                hidden[lo:hi].to(weight.dtype) @ w.t(), col[lo:hi], in_shard[lo:hi], temperature, cdt, with_entropy
            )
            m_loc[lo:hi] = mr
            stats[0, lo:hi] = sr
            if er is not None:
                stats[1, lo:hi] = er
            stats[2:, lo:hi] = zy.t()
        m = m_loc.clone()
        if multi:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
        has = torch.isfinite(m_loc)  # a rank whose shard is all padding contributes nothing
        delta = torch.where(has, m_loc - m, torch.zeros_like(m))
        a = torch.where(has, torch.exp(delta), torch.zeros_like(m))
        zy_shifted = torch.where(in_shard.t(), stats[2:] - m, torch.zeros_like(stats[2:]))  # [K, N]
        red = torch.cat([torch.stack([a * stats[0], a * (stats[1] + delta * stats[0])]), zy_shifted])
        if multi:
            dist.all_reduce(red, op=dist.ReduceOp.SUM, group=tp_group)
        log_sum = red[0].log()
        valid = (targets >= 0) & (targets < vocab_size)  # [N, K]
        zy_all = red[2:].t()  # [N, K]
        logprobs = torch.where(valid, zy_all - log_sum[:, None], torch.zeros_like(zy_all))
        entropy = log_sum - red[1] / red[0] if with_entropy else logprobs.new_zeros(0)

        ctx.save_for_backward(hidden, weight, col, in_shard, valid, m + log_sum, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy, ctx.valid_cols = temperature, chunk, with_entropy, valid_cols
        ctx.ops = ops
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, col, in_shard, valid, norm, entropy = ctx.saved_tensors
        nones = (None,) * 7
        use_entropy = ctx.with_entropy and grad_entropy is not None
        if grad_logprobs is None and not use_entropy:
            return (None, None) + nones
        if grad_logprobs is not None:  # ignored targets have a constant log-prob 0
            grad_logprobs = torch.where(valid, grad_logprobs, torch.zeros_like(grad_logprobs))
        n = hidden.shape[0]
        temperature, chunk, valid_cols = ctx.temperature, ctx.chunk, ctx.valid_cols
        w = weight[:valid_cols]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_h else None
        acc_dt = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc_dt, device=weight.device) if need_w else None
        grad_ent = grad_entropy if use_entropy else None
        ops = ctx.ops
        for lo in range(0, n if valid_cols else 0, chunk):
            hi = min(lo + chunk, n)
            h = hidden[lo:hi].to(weight.dtype)
            g = ops.grad(  # [c, V/tp]: the logits' gradient, GEMM dtype
                h @ w.t(),
                norm[lo:hi],
                temperature,
                entropy[lo:hi] if use_entropy else None,
                None if grad_logprobs is None else grad_logprobs[lo:hi],
                None if grad_ent is None else grad_ent[lo:hi],
                col[lo:hi],
                in_shard[lo:hi],
            )
            if grad_hidden is not None:  # (need_h)
                grad_hidden[lo:hi] = (g @ w).to(hidden.dtype)
            if grad_w is not None:  # (need_w)
                grad_w[:valid_cols].add_(g.t() @ h)  # fp32 += the GEMM dtype: upcast in the add, no copy
            del g
        return (grad_hidden, None if grad_w is None else grad_w.to(weight.dtype)) + nones


def fused_vocab_parallel_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    vocab_size: int | None = None,
    kernels: Kernels = "auto",
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target token (and the entropy of each token's distribution) from hidden states.

    Equals ``vocab_parallel_logprobs(hidden @ weight.T, targets, ...)`` in value and gradient without
    the logits (see the module docstring for the math and memory).

    Args:
        hidden: [..., H] hidden states entering the output layer, identical on every TP rank.
        weight: [V/tp, H] this rank's vocab shard of the output (or tied embedding) weight.
        targets: [...] global token ids, or [..., K] (as many dimensions as ``hidden``): K targets
            per token scored in one pass; ids outside [0, vocab) give log-prob 0 with no gradient.
        tp_group: tensor-parallel group (``None``: the whole vocab is local).
        temperature: logits are divided by it (the rollout engine's sampling temperature).
        chunk_size: tokens per chunk; default keeps one [chunk, V/tp] temporary near 256 MiB (fp32 with
            eager kernels, the weight's dtype with compiled ones: twice the tokens in bf16).
        with_entropy: also return the entropy [...] (else ``None``).
        vocab_size: the real vocabulary when the output layer is padded (padded rows left out).
        kernels: the per-chunk softmax arithmetic: "auto" (torch.compile'd on CUDA with Triton,
            eager elsewhere), "eager" or "compiled" (:mod:`gspo_megatron.losses.chunk_kernels`).
    Returns:
        (logprobs [...] (or [..., K]), entropy [...] or None) in fp32 (fp64 for an fp64 weight), identical on every
        TP rank; differentiable in ``hidden`` (this rank's partial gradient, see the module docstring)
        and ``weight``. Every rank of ``tp_group`` calls it (collectives).
    """
    if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden [..., H] and weight [V/tp, H] disagree: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}"
        )
    several = targets.dim() == hidden.dim()  # [..., K] targets
    if hidden.shape[:-1] != (targets.shape[:-1] if several else targets.shape):
        raise ValueError(
            f"hidden [..., H] and targets [...] disagree: hidden {tuple(hidden.shape)}, targets {tuple(targets.shape)}"
        )
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise TypeError(f"hidden and weight must be floating point, got {hidden.dtype}, {weight.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must hold integer token ids, got {targets.dtype}")
    if not (temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    tp = group_size(tp_group)
    if vocab_size is not None and not (1 <= vocab_size <= weight.shape[0] * tp):
        raise ValueError(f"vocab_size must be in [1, V/tp * tp = {weight.shape[0] * tp}], got {vocab_size}")
    lead = hidden.shape[:-1]
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(flat_h.shape[0], targets.shape[-1] if several else 1).long()  # [N, K]
    ops = chunk_ops(hidden.device, kernels, weight.dtype)
    chunk = chunk_tokens(chunk_size, weight.shape[0], ops.temp_bytes(weight.dtype))
    logprobs, entropy = _FusedVocabParallelLogprobs.apply(
        flat_h, weight, flat_t, tp_group, float(temperature), chunk, with_entropy, vocab_size, ops
    )
    logprobs = logprobs.view(targets.shape) if several else logprobs.view(lead)
    return logprobs, (entropy.view(lead) if with_entropy else None)
