"""The token chunking and per-chunk softmax backward shared by the two log-prob paths
(:mod:`gspo_megatron.losses.vocab_parallel` from logits, :mod:`gspo_megatron.losses.fused_logprobs`
from hidden states); the planner reads :data:`DEFAULT_CHUNK_BYTES` for the fused head's memory.

Shapes: N tokens, c tokens of one chunk, V/tp this rank's vocab shard (columns).
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK_BYTES = 256 * 2**20  # fp32 budget of one [chunk, V/tp] temporary


def chunk_tokens(chunk_size: int | None, vocab_local: int, temp_bytes: int = 4) -> int:
    """Tokens per chunk: ``chunk_size``, or (None) as many as keep one [c, V/tp] temporary of
    ``temp_bytes`` per element (fp32: 4) within DEFAULT_CHUNK_BYTES:
    c = max(1, DEFAULT_CHUNK_BYTES // (temp_bytes * V/tp))."""
    if chunk_size is None:
        return max(1, DEFAULT_CHUNK_BYTES // (temp_bytes * max(vocab_local, 1)))
    return chunk_size


def local_targets(targets: Tensor, vocab_start: int, vocab_local: int) -> tuple[Tensor, Tensor]:
    """targets [N, K] global ids (K targets per token) -> (column of each target in this shard
    [N, K], clamped to a valid column; whether it is in this shard [N, K] bool)."""
    local = targets - vocab_start
    in_shard = (local >= 0) & (local < vocab_local)
    return torch.where(in_shard, local, torch.zeros_like(local)), in_shard


def softmax_chunk_grad(
    logp: Tensor,
    entropy: Tensor | None,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    col: Tensor,
    in_shard: Tensor,
) -> Tensor:
    """Gradient with respect to the scaled logits z = logits / T of one chunk, from its log-softmax.

    Args (all for the chunk's c tokens, K targets each): logp [c, V/tp] = log p_v (overwritten: the
    result reuses its memory); entropy [c] H; grad_logprobs [c, K] (None: no log-prob gradient; 0
    for ignored targets); grad_entropy [c] (None: no entropy gradient); col, in_shard [c, K] from
    :func:`local_targets`.
    Returns g [c, V/tp] = sum_k grad_logprobs_k * (1[v = y_k] - p_v) + grad_entropy * (-p_v (log p_v + H));
    the caller multiplies by dz/dlogits = 1/T. At least one of the two gradients is given. (K = 1
    is the same arithmetic as one target: the sum over k of one term is that term.)
    """
    p = torch.exp(logp)
    g_sum = None if grad_logprobs is None else grad_logprobs.sum(dim=-1)  # [c]: sum_k g_k
    if grad_entropy is not None:  # dH/dz = -p (log p + H)
        assert entropy is not None  # the entropy gradient comes with the entropy
        g = logp.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None])
        if g_sum is not None:
            g.sub_(p.mul_(g_sum[:, None]))
    else:
        assert g_sum is not None  # at least one of the two gradients is given
        g = p.mul_(-g_sum[:, None])
    del p
    if grad_logprobs is not None:
        g_y = torch.where(in_shard, grad_logprobs, torch.zeros_like(grad_logprobs))
        g.scatter_add_(1, col, g_y)
    return g
