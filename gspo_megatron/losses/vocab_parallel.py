"""Log-probs and entropy of target tokens from vocab-parallel logits, chunked over tokens.

Every tensor-parallel rank calls :func:`vocab_parallel_logprobs` with its vocab shard of the logits
[N, V/tp] (rank r holds ids [r * V/tp, (r + 1) * V/tp), Megatron's layout) and the same targets [N]
(or [N, K]: K targets per token, e.g. a teacher's top-k ids, scored in the same pass: the softmax
statistics are shared, only the gathered columns differ).
Forward, over chunks of tokens (at most ``chunk_size`` x V/tp fp32 values alive at once):

    z = logits.float() / temperature                        (exactly as the rollout engine scales)
    m = allreduce_max(max_v z)                              (one collective for all chunks)
    S = allreduce_sum(sum_v exp(z - m)),  z_y = allreduce_sum(z[target] - m if the target is local)
    logp = z_y - log S,   entropy = log S - allreduce_sum(sum_v exp(z - m) * (z - m)) / S

(the three sums travel in one collective). With ``vocab_size`` set, the columns of Megatron's vocab
padding are left out of the softmax. Backward recomputes the softmax per chunk from the saved
logits and the [N] statistics, needs no collective, and writes each rank's gradient for its own shard:

    dlogp/dz_v = 1[v = y] - p_v,      dH/dz_v = -p_v * (log p_v + H),      dz/dlogits = 1 / temperature

Written here rather than reusing Megatron's vocab_parallel_cross_entropy because that one keeps the
full [N, V/tp] fp32 softmax alive for backward and has no entropy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_megatron.losses.chunking import chunk_tokens, local_targets, softmax_chunk_grad
from gspo_megatron.losses.reductions import group_rank, group_size


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        logits_all: Tensor,
        targets: Tensor,
        tp_group,
        temperature: float,
        chunk: int,
        with_entropy: bool,
        vocab_size: int | None,
    ):
        n, vocab_local = logits_all.shape
        vocab_start = group_rank(tp_group) * vocab_local
        multi = group_size(tp_group) > 1
        cdt = torch.promote_types(logits_all.dtype, torch.float32)  # fp32 math (fp64 stays fp64 for checks)
        if vocab_size is None:
            vocab_size = vocab_local * group_size(tp_group)
        # Columns past the real vocab (Megatron's vocab padding) are left out of the softmax.
        valid_cols = max(0, min(vocab_local, vocab_size - vocab_start))
        logits = logits_all[:, :valid_cols]

        # Pass 1: row max of the raw logits (T > 0, so max(z) = max(logits) / T, the same rounding).
        shift = torch.full((n,), -torch.inf, dtype=cdt, device=logits.device)
        for lo in range(0, n if valid_cols else 0, chunk):
            shift[lo : lo + chunk] = logits[lo : lo + chunk].max(dim=-1).values.to(cdt) / temperature
        if multi:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)

        # Pass 2: sum exp, the K target logits, sum exp * z (all shifted by the global max); rows
        # [S, z_y1 .. z_yK, E] of one tensor, so that one collective sums them all.
        k = targets.shape[1]
        stats = torch.zeros(1 + k + (1 if with_entropy else 0), n, dtype=cdt, device=logits.device)
        col, in_shard = local_targets(targets, vocab_start, valid_cols)
        for lo in range(0, n if valid_cols else 0, chunk):
            hi = min(lo + chunk, n)
            z = logits[lo:hi].to(cdt, copy=True).div_(temperature).sub_(shift[lo:hi, None])  # [c, V/tp]
            zy = z.gather(1, col[lo:hi])  # [c, K]
            stats[1 : 1 + k, lo:hi] = torch.where(in_shard[lo:hi], zy, torch.zeros_like(zy)).t()
            if with_entropy:
                e = torch.exp(z)
                stats[0, lo:hi] = e.sum(dim=-1)
                stats[1 + k, lo:hi] = (e.mul_(z)).sum(dim=-1)
                del e
            else:
                stats[0, lo:hi] = z.exp_().sum(dim=-1)
            del z
        if multi:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=tp_group)

        log_sum = stats[0].log()
        valid = (targets >= 0) & (targets < vocab_size)  # [N, K]
        zy_all = stats[1 : 1 + k].t()  # [N, K]
        logprobs = torch.where(valid, zy_all - log_sum[:, None], torch.zeros_like(zy_all))
        entropy = log_sum - stats[1 + k] / stats[0] if with_entropy else logprobs.new_zeros(0)

        ctx.save_for_backward(logits_all, col, in_shard, valid, shift, log_sum, entropy)
        ctx.temperature = temperature
        ctx.chunk = chunk
        ctx.with_entropy = with_entropy
        ctx.valid_cols = valid_cols
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        logits_all, col, in_shard, valid, shift, log_sum, entropy = ctx.saved_tensors
        if grad_logprobs is None and (grad_entropy is None or not ctx.with_entropy):
            return None, None, None, None, None, None, None
        if grad_logprobs is not None:  # ignored targets have a constant log-prob 0
            grad_logprobs = torch.where(valid, grad_logprobs, torch.zeros_like(grad_logprobs))
        n, vocab_local = logits_all.shape
        temperature, chunk, valid_cols = ctx.temperature, ctx.chunk, ctx.valid_cols
        logits = logits_all[:, :valid_cols]
        pad = valid_cols < vocab_local
        grad_logits_all = torch.zeros_like(logits_all) if pad else torch.empty_like(logits_all)
        grad_logits = grad_logits_all[:, :valid_cols]
        use_entropy = ctx.with_entropy and grad_entropy is not None
        grad_ent = grad_entropy if use_entropy else None
        for lo in range(0, n if valid_cols else 0, chunk):
            hi = min(lo + chunk, n)
            # log p_v = z_v - m - log S, recomputed for this chunk only.
            logp = logits[lo:hi].to(shift.dtype, copy=True).div_(temperature)
            logp.sub_(shift[lo:hi, None] + log_sum[lo:hi, None])
            g = softmax_chunk_grad(
                logp,
                entropy[lo:hi] if use_entropy else None,
                None if grad_logprobs is None else grad_logprobs[lo:hi],
                None if grad_ent is None else grad_ent[lo:hi],
                col[lo:hi],
                in_shard[lo:hi],
            )
            grad_logits[lo:hi] = g.div_(temperature)
            del g
        return grad_logits_all, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = True,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target token and (optionally) the entropy of each token's distribution.

    Args:
        logits: [..., V/tp] this rank's vocab shard (any float dtype; math in fp32).
        targets: [...] global token ids (long), or [..., K] (as many dimensions as ``logits``): K
            targets per token scored in one pass. Ids outside [0, V) (e.g. -100 padding) give
            log-prob 0 with no gradient (their entropy is still computed).
        tp_group: tensor-parallel group (``None``: the full vocab is local).
        temperature: the rollout engine's sampling temperature (logits are divided by it).
        chunk_size: tokens per chunk; default keeps one [chunk, V/tp] fp32 temporary near 256 MiB.
        with_entropy: also return the entropy [...] (else ``None``).
        vocab_size: the real vocabulary size when Megatron padded the output layer
            (V/tp * tp > vocab_size): padded columns are left out of the softmax, as in the rollout
            engine, and get zero gradient. None: every column is a real token.
    Returns:
        (logprobs [...] (or [..., K]), entropy [...] or None), fp32 (fp64 for fp64 logits), identical
        on every TP rank; differentiable with respect to ``logits``.
    Called by every rank of ``tp_group`` with the same targets (it runs collectives).
    """
    several = logits.dim() >= 1 and targets.dim() == logits.dim()  # [..., K] targets
    if logits.dim() < 1 or logits.shape[:-1] != (targets.shape[:-1] if several else targets.shape):
        raise ValueError(
            f"logits [..., V/tp] and targets [...] disagree: logits {tuple(logits.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must hold integer token ids, got {targets.dtype}")
    if not (temperature > 0):
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if vocab_size is not None and not (1 <= vocab_size <= logits.shape[-1] * group_size(tp_group)):
        raise ValueError(
            f"vocab_size must be in [1, V/tp * tp = {logits.shape[-1] * group_size(tp_group)}], got {vocab_size}"
        )
    lead = logits.shape[:-1]
    flat_logits = logits.reshape(-1, logits.shape[-1])
    k = targets.shape[-1] if several else 1
    flat_targets = targets.reshape(flat_logits.shape[0], k).long()  # [N, K]
    chunk = chunk_tokens(chunk_size, flat_logits.shape[1])
    logprobs, entropy = _VocabParallelLogprobs.apply(
        flat_logits, flat_targets, tp_group, float(temperature), chunk, with_entropy, vocab_size
    )
    logprobs = logprobs.view(targets.shape) if several else logprobs.view(lead)
    return logprobs, (entropy.view(lead) if with_entropy else None)
