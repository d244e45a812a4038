"""Per-sequence sums over flat token tensors and the collectives of the loss path.

The loss path represents padded, packed (THD) and context-parallel batches the same way: flat per-token
tensors [N] plus ``seq_index`` [N] (which sequence of the micro-batch each token belongs to). These
helpers turn that into per-sequence sums [S] and reduce them over a process group (``None`` means a
single rank: no collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import Tensor


def group_size(group: dist.ProcessGroup | None) -> int:
    """World size of ``group``; 1 for ``None`` (single rank, no collective)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """Rank inside ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def segment_sum(values: Tensor, seq_index: Tensor, num_seqs: int) -> Tensor:
    """Sum ``values`` [..., N] into ``num_seqs`` buckets by ``seq_index`` [N] -> [..., S] (differentiable)."""
    out = values.new_zeros(values.shape[:-1] + (num_seqs,))
    return out.index_add(-1, seq_index, values)


def all_reduce_sum(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Differentiable all-reduce (sum) over ``group``.

    Backward all-reduces the incoming gradient (torch.distributed.nn's adjoint of a sum): each rank's
    loss is its *share* of the total (the shares add up over the group), so the gradient of the total
    with respect to any rank's input is the sum of all ranks' upstream gradients. Each rank still
    backpropagates only into its own tokens. Identity for a single rank.
    """
    if group_size(group) == 1:
        return x
    return dist_fn.all_reduce(x, op=dist.ReduceOp.SUM, group=group)


def all_reduce_sum_(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """In-place, non-differentiable all-reduce (sum); returns ``x``. No-op for a single rank."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def seq_index_from_cu_seqlens(cu_seqlens: Tensor, total_tokens: int) -> Tensor:
    """Sequence id [total_tokens] of each token of a packed (THD) row, from ``cu_seqlens`` [S + 1].

    Positions past ``cu_seqlens[-1]`` (tail padding) get 0; they must be masked out of the loss.
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    used = int(cu_seqlens[-1])
    if int(cu_seqlens[0]) != 0 or used > total_tokens:
        raise ValueError(
            f"cu_seqlens must start at 0 and end at most at total_tokens={total_tokens}, "
            f"got {int(cu_seqlens[0])}..{used}"
        )
    ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    return torch.cat([ids, ids.new_zeros(total_tokens - used)])


def seq_index_for_rows(batch: int, seq_len: int, device: torch.device | None = None) -> Tensor:
    """Sequence id [batch, seq_len] of a padded batch: each row is one sequence."""
    return torch.arange(batch, device=device).unsqueeze(1).expand(batch, seq_len)
