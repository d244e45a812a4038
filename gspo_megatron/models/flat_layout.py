"""Byte layout of tensors packed into one uint8 buffer: the export stream's bucketed (E)TP gather
(``models.weights._gather_bucket``: a bucket's shards in one all-gather) and the weight sync's flat
buckets (``weight_sync.buckets.FlatBucketSink``: a bucket's tensors as views into one reused buffer)
lay out their tensors with the same arithmetic, here.

- ``tensor_bytes(shape, dtype)``: prod(shape) * itemsize.
- ``pack_aligned(sizes, starts)``: byte offsets of pieces placed one after another; a piece that
  starts a run begins at the next ``ALIGN``-byte boundary.
- ``flat_layout(pieces)``: pieces grouped into segments (each ``ALIGN``-aligned), widest elements
  first inside a segment, so every piece is element-aligned.
- ``view(flat, offset, shape, dtype)``: the tensor of that shape and dtype at byte ``offset``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch

ALIGN = 16  # byte alignment of each run (a gathered shard, an owner's segment of a flat bucket)


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` (() for a scalar: one element) and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def pack_aligned(sizes: Sequence[int], starts: Sequence[bool]) -> tuple[list[int], int]:
    """Byte offsets of pieces of ``sizes`` bytes placed in order: piece i begins where piece i-1
    ended, rounded up to a multiple of ``ALIGN`` where ``starts[i]`` (piece 0 begins at 0). Returns
    (offsets, total bytes = end of the last piece)."""
    offsets, pos = [], 0
    for n, start in zip(sizes, starts):
        if start:
            pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += n
    return offsets, pos


def flat_layout(pieces: Sequence[tuple[Hashable, int, int]]) -> tuple[list[int], list[tuple[Any, int, int]], int]:
    """Byte offsets of ``pieces`` ((segment key, element size, bytes)) in one buffer: grouped by
    segment key (first-seen order; each segment starts ``ALIGN``-aligned), widest elements first
    inside a segment (stable), so every piece is element-aligned. Returns (offsets in piece order,
    [(segment key, start, end)] in buffer order, total bytes)."""
    rank: dict[Hashable, int] = {}
    for seg, _, _ in pieces:
        rank.setdefault(seg, len(rank))
    order = sorted(range(len(pieces)), key=lambda i: (rank[pieces[i][0]], -pieces[i][1]))
    starts = [j == 0 or pieces[i][0] != pieces[order[j - 1]][0] for j, i in enumerate(order)]
    placed, total = pack_aligned([pieces[i][2] for i in order], starts)
    offsets = [0] * len(pieces)
    segments: list[tuple[Any, int, int]] = []
    for j, i in enumerate(order):
        offsets[i] = placed[j]
        seg, end = pieces[i][0], placed[j] + pieces[i][2]
        if starts[j]:
            segments.append((seg, placed[j], end))
        else:
            segments[-1] = (seg, segments[-1][1], end)
    return offsets, segments, total


def view(flat: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The ``shape`` tensor of ``dtype`` whose bytes are ``flat[offset:]`` (``flat``: 1-D uint8)."""
    return flat[offset : offset + tensor_bytes(shape, dtype)].view(dtype).view(shape)
