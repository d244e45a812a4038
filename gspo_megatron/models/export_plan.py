"""The export plan: every exported Megatron tensor as an ``_Item`` (the same on every rank), in
stream order, and its cut into buckets. ``models.weights.build_export_plan`` makes the items from
the model (one all_gather_object); what follows from the items alone is here.

- ``sort_key``: the stream order (embedding, then layer by layer in natural HF-name order, experts
  in index order, then the rest).
- ``group_fused(items)``: each fuse group's members (``mapping.FuseGroup``) moved next to each other.
- ``_buckets(items, bucket_bytes)``: greedy buckets of at most ``bucket_bytes`` that never cut a fuse
  group (a single larger item or group gets a bucket of its own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

import torch

from gspo_megatron.models.flat_layout import tensor_bytes
from gspo_megatron.models.param_names import LAYER


@dataclass
class _Item:
    """One Megatron parameter in the export plan (known identically on every rank)."""

    key: tuple
    global_name: str
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    owner: int  # global rank that assembles the HF tensors
    stack: tuple[int, int] | None = None  # (expert, num_experts): a row of stacked HF tensors
    fuse: tuple | None = None  # the fuse group instance (``MappingRegistry.fuse_key``), if any
    copies: tuple[int, ...] = ()  # other ranks holding the full tensors without a gather (expert-DP replicas)

    @property
    def nbytes(self) -> int:
        """Bytes of its HF tensors together."""
        return sum(tensor_bytes(s, self.dtype) for s in self.hf_shapes)


def sort_key(global_name: str, hf_names, expert: int | None = None) -> tuple:
    """An item's place in the stream: the embedding first, then by layer, the first HF name in
    natural order (``experts.10`` after ``experts.9``) and the expert row; everything else last."""
    m = LAYER.match(global_name)
    if global_name.startswith("embedding."):
        return (-1, hf_names[0])
    if m:
        return (int(m.group(1)), _natural(hf_names[0]), -1 if expert is None else expert)
    return (1 << 30, hf_names[0])


def _natural(s: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s))


def group_fused(items: list[_Item]) -> list[_Item]:
    """``items`` with the members of each fuse group moved up to follow the group's first member
    (in their own order); everything else keeps its place. The sorted HF names put other tensors
    between a group's parts (DeepSeek: ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, ...,
    ``q_a_proj``); adjacent, ``_buckets`` can keep them in one bucket."""
    members: dict[tuple, list[_Item]] = {}
    for it in items:
        if it.fuse is not None:
            members.setdefault(it.fuse, []).append(it)
    out, placed = [], set()
    for it in items:
        if it.fuse is None:
            out.append(it)
        elif it.fuse not in placed:
            placed.add(it.fuse)
            out.extend(members[it.fuse])
    return out


def _units(items: list[_Item]) -> Iterator[list[_Item]]:
    """The plan in indivisible runs: one item, or the adjacent members of one fuse group."""
    unit: list[_Item] = []
    for it in items:
        if unit and (it.fuse is None or it.fuse != unit[0].fuse):
            yield unit
            unit = []
        unit.append(it)
    if unit:
        yield unit


def _buckets(items: list[_Item], bucket_bytes: int) -> Iterator[list[_Item]]:
    """Greedy buckets of at most ``bucket_bytes``, never cutting a fuse group (``_units``); a unit
    larger than the limit gets a bucket of its own."""
    bucket: list[_Item] = []
    size = 0
    for unit in _units(items):
        nbytes = sum(it.nbytes for it in unit)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.extend(unit)
        size += nbytes
    if bucket:
        yield bucket
