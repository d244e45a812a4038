"""Moving weights between this rank's Megatron model and the Hugging Face layout.

Parameters, and the buffers a family maps (the MoE router's ``expert_bias``: DeepSeek's
``e_score_correction_bias``, not trained by the policy loss), travel alike.

- ``global_names(model)`` (``models/param_names.py``): local parameter (and buffer) name -> global name (layer and expert indices over the
  whole model, independent of the pipeline stage and expert-parallel rank).
- ``load_hf_weights(model, hf_dir)``: every rank fills its own shards from HF safetensors, reading
  one tensor at a time (bounded memory); of a tensor that stacks every expert of a layer (gpt-oss,
  rules with ``stacked_experts``) only this rank's expert rows are read.
- ``export_hf_weights(model, bucket_bytes)``: a collective generator, called on every rank: gathers
  tensor-parallel (and expert-tensor-parallel) shards, renames to HF, collects the full tensors on
  global rank 0 and yields them there in buckets of at most ``bucket_bytes`` (a single larger tensor
  gets a bucket of its own); other ranks yield ``None`` once per bucket. A family's fuse groups
  (``mapping.FuseGroup``: HF tensors the engine fuses only when they arrive in one ``load_weights``
  call, e.g. DeepSeek's ``q_a_proj`` + ``kv_a_proj_with_mqa``) are placed next to each other in the
  plan and never cut: a group that does not fit the current bucket starts the next one, and a group
  larger than ``bucket_bytes`` gets a bucket of its own, whole. Stacked-expert rows are
  collected on the receiving rank and yielded as the stacked tensor in the bucket of the last row. The same stream feeds HF
  export (tools/megatron_to_hf.py) and weight sync to the rollout engines.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator, cast

import torch
import torch.distributed as dist

from gspo_megatron.checkpoint.safetensors_shards import memory_bytes, pread_into
from gspo_megatron.dtypes import dtype_name, torch_dtype
from gspo_megatron.models import hf_config
from gspo_megatron.models.mapping import Rule
from gspo_megatron.models.param_names import LAYER, global_names, named_tensors
from gspo_megatron.models.registry import get_family
from gspo_megatron.runtime import distributed as rdist


def weight_data(param) -> torch.Tensor:
    """What the export stream reads of a parameter: its merged weight ``W_t + s B_t A_t`` when it is a
    LoRA base weight (``param.lora_merged``, set by ``models.lora``), else its data."""
    merged = getattr(param, "lora_merged", None)
    return merged() if merged is not None else param.data


def _mapped(model, mapping):
    """(local name, global name, rule, hf names, tensor) of every parameter (each must have a rule)
    and of every buffer that has one."""
    names = global_names(model)
    params = {n for n, _ in model.named_parameters()}
    for local, t in named_tensors(model):
        if getattr(t, "lora_adapter", False):  # LoRA A/B: merged into their base weight on export
            continue
        found = mapping.resolve(names[local]) if local in params else mapping.find(names[local])
        if found is not None:
            yield local, names[local], found[0], found[1], t


def _group(parallel: str | None):
    from megatron.core import parallel_state as ps

    if parallel == "tp":
        return ps.get_tensor_model_parallel_group()
    if parallel == "etp":
        return ps.get_expert_tensor_parallel_group()
    return None


def _rank_size(parallel: str | None) -> tuple[int, int]:
    group = _group(parallel)
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class SafetensorsReader:
    """Reads named tensors from an HF directory (single file or sharded with an index).

    ``get`` returns safetensors' zero-copy view of the memory-mapped file. ``copy_into(dst, src)``
    fills a parameter (or a contiguous block of one) from such a view with ``pread`` into the
    parameter's memory when ``src`` is a contiguous run of the file in ``dst``'s dtype, else with
    ``dst.copy_(src)``. Going around safetensors here: copying out of its mmap page-faults every
    4 KiB page of the file into this process (1.2 s of a 1.7 s conversion of 246 MB on a busy
    2-core machine, against 0.1-0.5 s for ``pread`` of the same bytes, which the kernel copies from
    its page cache the way ``cp`` does). The file offset of a view comes from the file's header
    (8-byte length + JSON, the safetensors format) and the view's distance from the tensor ``get``
    returned."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self.where = json.load(f)["weight_map"]
        elif os.path.exists(single):
            with safe_open(single, "pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}")
        self._open: dict[str, Any] = {}  # file -> its safetensors ``safe_open`` handle
        self._fds: dict[str, int] = {}
        self._offsets: dict[str, dict[str, int]] = {}  # file -> tensor -> absolute byte offset
        # the last tensors ``get`` returned, kept alive (so no other tensor can take their
        # addresses): (tensor, fd, file offset)
        self._recent: list[tuple[torch.Tensor, int, int]] = []
        self._safe_open = safe_open

    def names(self) -> list[str]:
        return list(self.where)

    def _file(self, name: str):
        if name not in self.where:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.hf_dir}")
        fname = self.where[name]
        if fname not in self._open:
            path = os.path.join(self.hf_dir, fname)
            try:
                self._open[fname] = self._safe_open(path, "pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types; one line naming the file
                raise ValueError(f"cannot read {path}: {e}") from None
        return self._open[fname]

    def _locate_file(self, fname: str) -> tuple[int, dict[str, int]]:
        if fname not in self._fds:
            path = os.path.join(self.hf_dir, fname)
            fd = os.open(path, os.O_RDONLY)
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, n, 8))
            header.pop("__metadata__", None)
            self._fds[fname] = fd
            self._offsets[fname] = {k: 8 + n + v["data_offsets"][0] for k, v in header.items()}
        return self._fds[fname], self._offsets[fname]

    def get(self, name: str) -> torch.Tensor:
        t = self._file(name).get_tensor(name)
        fd, offsets = self._locate_file(self.where[name])
        if name in offsets and t.numel():
            self._recent = self._recent[-7:] + [(t, fd, offsets[name])]
        return t

    def get_row(self, name: str, index: int) -> torch.Tensor:
        """``get(name)[index]``, reading only that row from disk (one expert of a stacked tensor)."""
        return self._file(name).get_slice(name)[index : index + 1][0]

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` (same shapes), by ``pread`` where ``src`` is a run of a file."""
        if dst.dtype == src.dtype and dst.device.type == "cpu" and dst.numel():
            if dst.is_contiguous() and src.is_contiguous():
                where = self._where(src)
                if where is not None:
                    pread_into(where[0], memory_bytes(dst), where[1], f"a safetensors file in {self.hf_dir}")
                    return
            elif dst.dim() > 1 and dst.shape[0] <= 4096 and dst[0].is_contiguous() and src[0].is_contiguous():
                for d, s_ in zip(dst, src):  # e.g. one query group of a fused QKV at a time
                    self.copy_into(d, s_)
                return
        dst.copy_(src)

    def _where(self, src: torch.Tensor) -> tuple[int, int] | None:
        p, n = src.data_ptr(), src.numel() * src.element_size()
        for t, fd, offset in self._recent:
            base, size = t.data_ptr(), t.numel() * t.element_size()
            if base <= p and p + n <= base + size:
                return fd, offset + (p - base)
        return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._recent = []


@torch.no_grad()
def load_hf_weights(model, hf_dir: str, progress: Callable[[int], object] | None = None) -> int:
    """Fill this rank's parameters from the HF checkpoint in ``hf_dir``. Every rank calls it (no
    communication). Returns the number of parameters set; raises KeyError naming a missing tensor.
    ``progress(1)`` is called after each parameter (a progress bar's update)."""
    mapping = get_family(model.hf_config).mapping(model.hf_config)
    reader = SafetensorsReader(hf_dir)
    n = 0
    try:
        for _, gname, rule, hf_names, param in _mapped(model, mapping):
            rank, size = _rank_size(rule.parallel)
            expert = rule.expert_index(gname)  # stacked experts: read only this expert's row
            full = [reader.get(h) if expert is None else reader.get_row(h, expert) for h in hf_names]
            try:
                rule.load_into(param, full, rank, size, copy=reader.copy_into)  # file -> param
            except ValueError as e:
                raise ValueError(
                    f"{hf_names} do not fit Megatron parameter {gname} of shape {tuple(param.shape)}: {e}"
                ) from None
            n += 1
            if progress is not None:
                progress(1)
    finally:
        reader.close()
    return n


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

    @property
    def nbytes(self) -> int:
        n = 0
        for s in self.hf_shapes:
            k = 1
            for d in s:
                k *= d
            n += k
        return n * torch.empty((), dtype=self.dtype).element_size()


# what each rank declares of the items it owns (``build_export_plan``): (global name, HF names, HF
# shapes, dtype name, owner rank, stack)
_Declared = tuple[str, tuple[str, ...], tuple[tuple[int, ...], ...], str, int, tuple[int, int] | None]


def _sort_key(global_name: str, hf_names, expert: int | None = None) -> tuple:
    m = LAYER.match(global_name)
    if global_name.startswith("embedding."):
        return (-1, hf_names[0])
    if m:
        return (int(m.group(1)), _natural(hf_names[0]), -1 if expert is None else expert)
    return (1 << 30, hf_names[0])


def _natural(s: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s))


def _is_dp_first(parallel: str | None) -> bool:
    from megatron.core import parallel_state as ps

    if parallel == "etp":
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0


def build_export_plan(model) -> tuple[list[_Item], dict[str, tuple[Rule, torch.nn.Parameter]]]:
    """The global, ordered export plan (collective: one all_gather_object) and this rank's part."""
    mapping = get_family(model.hf_config).mapping(model.hf_config)
    mine: dict[str, tuple[Rule, torch.nn.Parameter]] = {}
    declared: list[_Declared] = []
    me = rdist.rank()
    for _, g, rule, hf_names, param in _mapped(model, mapping):
        if not rule.export or not _is_dp_first(rule.parallel):
            continue
        mine[g] = (rule, param)
        rank, size = _rank_size(rule.parallel)
        if rank == 0:
            meta = [torch.empty(param.shape, dtype=param.dtype, device="meta")] * size
            shapes = tuple(tuple(t.shape) for t in rule.from_shards(meta))
            expert = rule.expert_index(g)
            stack = None if expert is None else (expert, hf_config.num_experts(model.hf_config))
            declared.append((g, hf_names, shapes, dtype_name(param.dtype), me, stack))
    everyone: list[list[_Declared]]
    if rdist.world_size() > 1:
        everyone = [[] for _ in range(dist.get_world_size())]  # each rank's ``declared``, filled in
        dist.all_gather_object(everyone, declared)
    else:
        everyone = [declared]
    items: dict[str, _Item] = {}
    for decl in everyone:
        for g, hf_names, shapes, dtype, owner, stack in decl:
            if g not in items or owner < items[g].owner:
                items[g] = _Item(
                    _sort_key(g, hf_names, stack and stack[0]),
                    g,
                    tuple(hf_names),
                    shapes,
                    torch_dtype(dtype),
                    owner,
                    stack,
                    mapping.fuse_key(hf_names),
                )
    return group_fused(sorted(items.values(), key=lambda it: it.key)), mine


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


ALL_RANKS = "all"


def _destination(dst, owner: int) -> int | None:
    """Where an item owned by ``owner`` goes: a rank, or None for every rank (``ALL_RANKS``)."""
    if dst == ALL_RANKS:
        return None
    return dst(owner) if callable(dst) else int(dst)


class FlatBucket(list):
    """A bucket (list of (HF name, tensor)) whose tensors are views into one uint8 buffer ``flat``
    (``export_hf_weights(..., flat=...)``): a transport can send ``flat`` as it is (one broadcast,
    or sglang's ``flattened_bucket`` payload) instead of flattening the tensors again. The views are
    element-aligned; ``byte_offset(t)`` is a tensor's place in ``flat``. They are valid until the
    stream's next bucket is requested (the buffer is reused)."""

    flat: torch.Tensor

    def byte_offset(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.flat.data_ptr()


class BucketBuffer:
    """One reusable uint8 buffer for ``export_hf_weights(flat=...)``, grown to the largest bucket;
    ``share``: in shared memory (CPU tensors then travel to another process without a copy)."""

    def __init__(self, share: bool = False):
        self.share = share
        self.buf: torch.Tensor | None = None

    def __call__(self, nbytes: int, device) -> torch.Tensor:
        device = torch.device(device)
        if self.buf is None or self.buf.numel() < nbytes or self.buf.device != device:
            self.buf = None  # free the old one first
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            if self.share and device.type == "cpu":
                buf.share_memory_()
            self.buf = buf
        return self.buf[:nbytes]


_ALIGN = 16  # byte alignment of each owner's segment of a flat bucket


def _flat_layout(entries: list, segment_of) -> tuple[list[int], list[tuple[int, int, int]], int]:
    """Byte offsets of ``entries`` ((item, hf index) pairs) in a flat bucket: grouped by
    ``segment_of(item)`` (first-seen order; each group starts ``_ALIGN``-aligned), widest elements
    first inside a group, so every view is element-aligned. Returns (offsets in entry order,
    [(segment key, start, end)], total bytes)."""
    keys: dict = {}
    for it, _ in entries:
        keys.setdefault(segment_of(it), len(keys))
    order = sorted(range(len(entries)), key=lambda i: (keys[segment_of(entries[i][0])], -entries[i][0].dtype.itemsize))
    offsets = [0] * len(entries)
    segments: list[tuple[int, int, int]] = []
    pos = 0
    for i in order:
        it, k = entries[i]
        seg = segment_of(it)
        if not segments or segments[-1][0] != seg:
            pos = -(-pos // _ALIGN) * _ALIGN
            segments.append((seg, pos, pos))
        offsets[i] = pos
        n = it.dtype.itemsize
        for d in it.hf_shapes[k]:
            n *= d
        pos += n
        segments[-1] = (seg, segments[-1][1], pos)
    return offsets, segments, pos


def _view(flat: torch.Tensor, offset: int, shape, dtype) -> torch.Tensor:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return flat[offset : offset + n].view(dtype).view(shape)


@torch.no_grad()
def export_hf_weights(
    model, bucket_bytes: int = 512 << 20, plan=None, dst=0, flat=None
) -> Iterator[list[tuple[str, torch.Tensor]] | None]:
    """Collective generator over buckets of full HF tensors (see module docstring). Every rank must
    iterate it to the end. ``plan`` may be a cached ``build_export_plan(model)``.

    ``dst`` says which rank receives each item's full tensors:
    - an int: that rank (HF export, the in-process engine): it yields each bucket, others yield None;
    - ``ALL_RANKS``: every rank (colocated engines: each training rank hands the bucket to the engine
      TP rank on its GPU); the owner broadcasts over the world group;
    - a callable ``owner_rank -> rank`` (disaggregated: each pipeline stage's source rank receives the
      items its stage owns and broadcasts them to the engines): a destination rank yields the part of
      each bucket routed to it (possibly an empty list), other ranks yield None.
    Buckets are cut from the global plan, so a destination's part of a bucket is at most
    ``bucket_bytes`` (a single larger tensor or fuse group excepted), and a fuse group (one layer's
    tensors, one owner) reaches its destination in one bucket.

    ``flat`` (same on every rank; None: plain lists): an allocator ``(nbytes, device) -> uint8
    tensor`` (e.g. :class:`BucketBuffer`). A receiving rank then gets each bucket as a
    :class:`FlatBucket` whose tensors are views into one buffer (buckets holding stacked-expert
    rows excepted), filled by copying (owner), receiving (``dist.recv``) or, with ``ALL_RANKS``,
    one broadcast per owner per bucket instead of one per tensor."""
    items, mine = plan if plan is not None else build_export_plan(model)
    if flat is not None:
        yield from _export_flat(items, mine, bucket_bytes, dst, flat)
        return
    me = rdist.rank()
    pending: dict[str, dict[int, torch.Tensor]] = {}  # stacked HF tensor -> its expert rows so far
    owners = {it.owner for it in items}
    destinations = {_destination(dst, o) for o in owners}
    receives = None in destinations or me in destinations
    for bucket in _buckets(items, bucket_bytes):
        out: list[tuple[str, torch.Tensor]] = []
        for it in bucket:
            tensors = gather_full(it, mine) if it.global_name in mine else None
            target = _destination(dst, it.owner)
            if target is None:  # every rank gets the item
                if tensors is None:
                    tensors = [torch.empty(s, dtype=it.dtype, device=_device()) for s in it.hf_shapes]
                if rdist.world_size() > 1:
                    tensors = [t.contiguous() for t in tensors]
                    for t in tensors:
                        dist.broadcast(t, src=it.owner)
            elif me == it.owner and me != target:
                if tensors is None:
                    raise RuntimeError(f"rank {me} owns {it.global_name} in the export plan but holds no shard of it")
                for t in tensors:
                    dist.send(t.contiguous(), dst=target)
                continue
            elif me != target:
                continue
            elif tensors is None:
                tensors = [torch.empty(s, dtype=it.dtype, device=_device()) for s in it.hf_shapes]
                for t in tensors:
                    dist.recv(t, src=it.owner)
            if it.stack is not None:
                out.extend(_stack_rows(pending, it, tensors))
                continue
            out.extend((n, t.clone() if _aliases_param(t, mine, it) else t) for n, t in zip(it.hf_names, tensors))
        yield out if receives else None


def _export_flat(items, mine, bucket_bytes: int, dst, alloc) -> Iterator[list[tuple[str, torch.Tensor]] | None]:
    """``export_hf_weights`` with ``flat``: the same collectives per item, except that with
    ``ALL_RANKS`` each bucket's items travel as one broadcast per owner (its segment of the buffer)."""
    me = rdist.rank()
    world = rdist.world_size()
    pending: dict[str, dict[int, torch.Tensor]] = {}
    destinations = {_destination(dst, it.owner) for it in items}
    receives = None in destinations or me in destinations
    # (E)TP groups spanning the whole world (e.g. tp = world): with ALL_RANKS every rank has every
    # shard of their items after the gather, so each assembles them itself (no broadcast)
    whole = {k for k in ("tp", "etp") if world > 1 and dst == ALL_RANKS and _rank_size(k)[1] == world}
    for bucket in _buckets(items, bucket_bytes):
        targets = [_destination(dst, it.owner) for it in bucket]
        shards = _gather_bucket(bucket, mine)
        local = {g for g in shards if targets[0] is None and mine[g][0].parallel in whole}
        entries = [
            (it, k) for it, tg in zip(bucket, targets) if tg is None or tg == me for k in range(len(it.hf_names))
        ]
        buf = None
        if entries and not any(it.stack is not None for it in bucket):
            # ALL_RANKS: one segment per owner (one broadcast each) and one of the ``local`` items;
            # else one gapless run
            offsets, segments, total = _flat_layout(
                entries,
                (lambda it: -1 if it.global_name in local else it.owner) if targets[0] is None else (lambda it: 0),
            )
            buf = alloc(total, _device())
            where = {(it.global_name, k): o for (it, k), o in zip(entries, offsets)}
        out: list[tuple[str, torch.Tensor]] = FlatBucket() if buf is not None else []
        for it, target in zip(bucket, targets):
            if it.global_name in shards:
                tensors = (
                    mine[it.global_name][0].from_shards(shards[it.global_name])
                    if me == it.owner or (buf is not None and it.global_name in local)
                    else None
                )
            else:
                tensors = gather_full(it, mine) if it.global_name in mine else None
            if target is not None and me == it.owner and me != target:
                if tensors is None:
                    raise RuntimeError(f"rank {me} owns {it.global_name} in the export plan but holds no shard of it")
                for t in tensors:
                    dist.send(t.contiguous(), dst=target)
                continue
            if target is not None and me != target:
                continue
            if buf is None:  # a bucket with stacked-expert rows: as the plain stream does
                if tensors is None:
                    tensors = [torch.empty(s, dtype=it.dtype, device=_device()) for s in it.hf_shapes]
                    for t in tensors:
                        if target is not None:
                            dist.recv(t, src=it.owner)
                        elif world > 1:
                            dist.broadcast(t, src=it.owner)
                elif target is None and world > 1:
                    tensors = [t.contiguous() for t in tensors]
                    for t in tensors:
                        dist.broadcast(t, src=it.owner)
                if it.stack is not None:
                    out.extend(_stack_rows(pending, it, tensors))
                else:
                    out.extend(
                        (n, t.clone() if _aliases_param(t, mine, it) else t) for n, t in zip(it.hf_names, tensors)
                    )
                continue
            views = [_view(buf, where[(it.global_name, k)], s, it.dtype) for k, s in enumerate(it.hf_shapes)]
            if tensors is not None:  # the owner (or, a ``local`` item, every rank)
                for v, t in zip(views, tensors):
                    v.copy_(t)
            elif target is not None:  # the destination, from the owner
                for v in views:
                    dist.recv(v, src=it.owner)
            out.extend(zip(it.hf_names, views))
        if buf is not None:
            if world > 1 and targets[0] is None:  # ALL_RANKS: every rank, segment by segment
                for owner, start, end in segments:
                    if owner != -1:  # -1: the ``local`` items, assembled on every rank
                        dist.broadcast(buf[start:end], src=owner)
            cast(FlatBucket, out).flat = buf
        yield out if receives else None


def _gather_bucket(bucket: list[_Item], mine: dict) -> dict[str, list[torch.Tensor]]:
    """The (E)TP shards of every item of ``bucket`` this rank holds a shard of, by one all-gather
    per parallel kind (``tp``, ``etp``: first-seen order, the same on every rank) of all those
    shards packed into one buffer, instead of one all-gather per item. global name -> [shard of
    group rank 0, 1, ...] (views into the gathered buffer)."""
    kinds: dict[str, list[_Item]] = {}
    for it in bucket:
        if it.global_name in mine:
            parallel = mine[it.global_name][0].parallel
            if parallel in ("tp", "etp"):
                kinds.setdefault(parallel, []).append(it)
    out: dict[str, list[torch.Tensor]] = {}
    if not dist.is_initialized():
        return out
    for parallel, its in kinds.items():
        group = _group(parallel)
        size = dist.get_world_size(group) if group is not None else 1
        if size == 1:
            continue
        datas = [weight_data(mine[it.global_name][1]) for it in its]
        offsets, pos = [], 0
        for d in datas:
            pos = -(-pos // _ALIGN) * _ALIGN
            offsets.append(pos)
            pos += d.numel() * d.element_size()
        pack = torch.empty(pos, dtype=torch.uint8, device=datas[0].device)
        for d, o in zip(datas, offsets):
            _view(pack, o, d.shape, d.dtype).copy_(d)
        gathered = [torch.empty_like(pack) for _ in range(size)]
        dist.all_gather(gathered, pack, group=group)
        for it, d, o in zip(its, datas, offsets):
            out[it.global_name] = [_view(g, o, d.shape, d.dtype) for g in gathered]
    return out


def gather_full(it: _Item, mine: dict) -> list[torch.Tensor] | None:
    """Item ``it``'s full HF tensors on its owner (None on the other ranks). Every rank holding a
    shard of it (``it.global_name in mine``) calls this, in plan order: the (E)TP all-gather of its
    group. The result may alias the owner's live parameter (size-1 groups)."""
    rule, param = mine[it.global_name]
    group = _group(rule.parallel)
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if size > 1:
        data = weight_data(param)  # a LoRA base weight: this rank's merged shard (models/lora.py)
        shards = [torch.empty_like(data) for _ in range(size)]
        dist.all_gather(shards, data.contiguous(), group=group)
    else:
        shards = [weight_data(param)]
    me = rdist.rank()
    return rule.from_shards(shards) if me == it.owner else None


def _stack_rows(pending: dict, it: _Item, tensors) -> list[tuple[str, torch.Tensor]]:
    """Collect expert ``it.stack[0]``'s rows of stacked HF tensors; return each stacked tensor
    [num_experts, ...] once its last row arrived (in the bucket of that row), else nothing."""
    if it.stack is None:
        raise ValueError(f"{it.global_name} is not a row of stacked HF tensors")
    expert, count = it.stack
    done = []
    for name, t in zip(it.hf_names, tensors):
        rows = pending.setdefault(name, {})
        rows[expert] = t
        if len(rows) == count:
            done.append((name, torch.stack([rows[e] for e in range(count)])))
            del pending[name]
    return done


def _device() -> torch.device:
    from gspo_megatron.runtime.distributed import device

    return device()


def _aliases_param(t: torch.Tensor, mine, it) -> bool:
    """Whether ``t`` shares memory with our own parameter for an item (the parameter itself, or a
    view of it such as a gated fc1's half): the stream copies those, never aliasing a live parameter."""
    entry = mine.get(it.global_name)
    return entry is not None and t.untyped_storage().data_ptr() == entry[1].untyped_storage().data_ptr()
