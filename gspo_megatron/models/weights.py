"""Moving weights between this rank's Megatron model and the Hugging Face layout.

Parameters, and the buffers a family maps (the MoE router's ``expert_bias``: DeepSeek's
``e_score_correction_bias``, not trained by the policy loss), travel alike.

- ``global_names(model)`` (``models/param_names.py``): local parameter (and buffer) name -> global name (layer and expert indices over the
  whole model, independent of the pipeline stage and expert-parallel rank).
- ``load_hf_weights(model, hf_dir)``: every rank fills its own shards from HF safetensors
  (``models/safetensors_reader.py``), reading one tensor at a time (bounded memory); of a tensor
  that stacks every expert of a layer (gpt-oss, rules with ``stacked_experts``) only this rank's
  expert rows are read.
- ``export_hf_weights(model, bucket_bytes)``: a collective generator, called on every rank: gathers
  tensor-parallel (and expert-tensor-parallel) shards, renames to HF, collects the full tensors on
  global rank 0 and yields them there in buckets of at most ``bucket_bytes`` (a single larger tensor
  gets a bucket of its own); other ranks yield ``None`` once per bucket. A family's fuse groups
  (``mapping.FuseGroup``: HF tensors the engine fuses only when they arrive in one ``load_weights``
  call, e.g. DeepSeek's ``q_a_proj`` + ``kv_a_proj_with_mqa``) are placed next to each other in the
  plan and never cut: a group that does not fit the current bucket starts the next one, and a group
  larger than ``bucket_bytes`` gets a bucket of its own, whole (the plan's items, order and
  buckets: ``models/export_plan.py``). Stacked-expert rows are collected on the receiving rank and
  yielded as the stacked tensor in the bucket of the last row. The same stream feeds HF export
  (tools/megatron_to_hf.py) and weight sync to the rollout engines; with ``flat`` (the SGLang sync
  modes) a bucket's tensors are views into one reused buffer (its byte layout:
  ``models/flat_layout.py``).
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Protocol, cast

import torch
import torch.distributed as dist

from gspo_megatron.dtypes import dtype_name, torch_dtype
from gspo_megatron.models import hf_config
from gspo_megatron.models.export_plan import _buckets, _Item, group_fused, sort_key
from gspo_megatron.models.flat_layout import flat_layout, pack_aligned, tensor_bytes, view
from gspo_megatron.models.mapping import Rule
from gspo_megatron.models.param_names import global_names, named_tensors
from gspo_megatron.models.registry import get_family
from gspo_megatron.models.safetensors_reader import SafetensorsReader
from gspo_megatron.runtime import distributed as rdist


def weight_data(param) -> torch.Tensor:
    """What the export stream reads of a parameter: its merged weight ``W_t + s B_t A_t`` when it is a
    LoRA base weight (``param.lora_merged``, set by ``models.lora``), else its data."""
    merged = getattr(param, "lora_merged", None)
    return merged() if merged is not None else param.data


def _mapped(model, mapping):
    """(local name, global name, rule, hf names, tensor) of every parameter (each must have a rule)
    and of every buffer that has one."""
    mapping = mapping.for_model(model)  # the rules of the layer spec it was built on (Rule.spec)
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


# what each rank declares of the items it owns (``build_export_plan``): (global name, HF names, HF
# shapes, dtype name, owner rank, stack)
_Declared = tuple[str, tuple[str, ...], tuple[tuple[int, ...], ...], str, int, tuple[int, int] | None]


def _is_dp_first(parallel: str | None) -> bool:
    from megatron.core import parallel_state as ps

    if parallel == "etp":
        return ps.get_expert_data_parallel_rank() == 0
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0


def build_export_plan(model) -> tuple[list[_Item], dict[str, tuple[Rule, torch.nn.Parameter]]]:
    """The global, ordered export plan (collective: one all_gather_object) and this rank's part.

    This rank's part: the parameters it owns or holds a shard of (its (E)TP group's (expert-)DP rank
    0), and the routed experts whose full copy it holds as another expert-DP replica (expert tensor
    parallel size 1): those are the item's ``copies`` (an owner-direct routing reads them in place of
    a transfer from the owner; nothing else uses them)."""
    mapping = get_family(model.hf_config).mapping(model.hf_config)
    mine: dict[str, tuple[Rule, torch.nn.Parameter]] = {}
    declared: list[_Declared] = []
    copies: list[str] = []
    me = rdist.rank()
    for _, g, rule, hf_names, param in _mapped(model, mapping):
        if not rule.export:
            continue
        if not _is_dp_first(rule.parallel):
            if rule.parallel == "etp" and _rank_size("etp")[1] == 1 and rule.expert_index(g) is None:
                mine[g] = (rule, param)  # a full replica: ``gather_full`` gives None here (not the owner)
                copies.append(g)
            continue
        mine[g] = (rule, param)
        rank, size = _rank_size(rule.parallel)
        if rank == 0:
            meta = [torch.empty(param.shape, dtype=param.dtype, device="meta")] * size
            shapes = tuple(tuple(t.shape) for t in rule.from_shards(meta))
            expert = rule.expert_index(g)
            stack = None if expert is None else (expert, hf_config.num_experts(model.hf_config))
            declared.append((g, hf_names, shapes, dtype_name(param.dtype), me, stack))
    everyone: list[tuple[list[_Declared], list[str]]]
    if rdist.world_size() > 1:
        everyone = [([], []) for _ in range(dist.get_world_size())]  # each rank's ``declared``, filled in
        dist.all_gather_object(everyone, (declared, copies))
    else:
        everyone = [(declared, copies)]
    held_by: dict[str, list[int]] = {}
    for r, (_, held) in enumerate(everyone):
        for g in held:
            held_by.setdefault(g, []).append(r)
    items: dict[str, _Item] = {}
    for decl, _ in everyone:
        for g, hf_names, shapes, dtype, owner, stack in decl:
            if g not in items or owner < items[g].owner:
                items[g] = _Item(
                    sort_key(g, hf_names, stack and stack[0]),
                    g,
                    tuple(hf_names),
                    shapes,
                    torch_dtype(dtype),
                    owner,
                    stack,
                    mapping.fuse_key(hf_names),
                    tuple(sorted(held_by.get(g, ()))),
                )
    return group_fused(sorted(items.values(), key=lambda it: it.key)), mine


ALL_RANKS = "all"


def _destination(dst, owner: int) -> int | None:
    """Where an item owned by ``owner`` goes: a rank, or None for every rank (``ALL_RANKS``, and the
    items an :class:`ItemRouting` leaves to every rank)."""
    if dst == ALL_RANKS or _routing(dst) is not None:
        return None
    return dst(owner) if callable(dst) else int(dst)


class ItemRouting(Protocol):
    """A ``dst`` of :func:`export_hf_weights` that sends some items to some ranks only (owner-direct
    colocated sync: ``weight_sync.owner_direct.OwnerDirectRouting``); every other item goes to
    every rank as with ``ALL_RANKS``.

    ``holders(item, local)`` -> None (every rank gets it), or {rank: what the rank serves with it}:
    the ranks that hold the item's full tensors in their bucket (the owner copies them, the others
    receive them from the owner by ``dist.send`` / ``dist.recv``; ``local``: every rank assembles the
    item itself from the bucket's (E)TP gather, so no transfer is needed). The values are opaque
    here and come back to the transport in the bucket's ``FlatBucket.slots``. Must be the same on
    every rank."""

    def holders(self, item: _Item, local: bool) -> dict[int, tuple] | None: ...


def _routing(dst) -> ItemRouting | None:
    return dst if hasattr(dst, "holders") else None


class FlatBucket(list):
    """A bucket (list of (HF name, tensor)) whose tensors are views into one uint8 buffer ``flat``
    (``export_hf_weights(..., flat=...)``): a transport can send ``flat`` as it is (one broadcast,
    or sglang's ``flattened_bucket`` payload) instead of flattening the tensors again. The views are
    element-aligned; ``byte_offset(t)`` is a tensor's place in ``flat``. They are valid until the
    stream's next bucket is requested (the buffer is reused)."""

    flat: torch.Tensor  # unset when the rank receives nothing of a routed bucket (or it has stacked rows)
    # with an ``ItemRouting``: HF name -> what this rank serves with it (names not in it: the rank's own),
    # and every item's holders in the bucket (None: every rank), the same on every rank
    slots: dict[str, tuple]
    routes: list[dict[int, tuple] | None]

    def __init__(self, *args):
        super().__init__(*args)
        self.slots = {}
        self.routes = []

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
    one broadcast per owner per bucket instead of one per tensor.

    Communication per bucket, the same sequence on every rank: without ``flat``, item by item, its
    (E)TP all-gather (:func:`gather_full`) then its send / recv or broadcasts; with ``flat``, one
    all-gather per parallel kind for the whole bucket (:func:`_gather_bucket`), then item by item
    its send / recv (broadcasts only in a bucket without a buffer), then with ``ALL_RANKS`` one
    broadcast per owner segment of the buffer."""
    items, mine = plan if plan is not None else build_export_plan(model)
    me, world = rdist.rank(), rdist.world_size()
    pending: dict[str, dict[int, torch.Tensor]] = {}  # stacked HF tensor -> its expert rows so far
    destinations = {_destination(dst, o) for o in {it.owner for it in items}}
    receives = None in destinations or me in destinations
    # flat, ALL_RANKS, (E)TP groups spanning the whole world (e.g. tp = world): every rank has every
    # shard of their items after the bucket's gather, so each assembles them itself (no broadcast)
    whole = {
        k for k in ("tp", "etp") if flat is not None and world > 1 and dst == ALL_RANKS and _rank_size(k)[1] == world
    }
    routing = _routing(dst)
    for bucket in _buckets(items, bucket_bytes):
        targets = [_destination(dst, it.owner) for it in bucket]
        shards = _gather_bucket(bucket, mine) if flat is not None else {}
        local = {g for g in shards if mine[g][0].parallel in whole}
        held = _held(routing, bucket, local, flat)
        layout = _buffer_layout(bucket, targets, local, flat, held) if flat is not None else None
        if layout is None:
            local = set()  # no buffer: only the owner assembles, and sends or broadcasts per tensor
        out: list[tuple[str, torch.Tensor]] = FlatBucket() if layout is not None or routing is not None else []
        if routing is not None:
            cast(FlatBucket, out).routes = held
        for it, target, holders in zip(bucket, targets, held):
            g = it.global_name
            if g in shards:
                tensors = mine[g][0].from_shards(shards[g]) if me == it.owner or g in local else None
            else:
                tensors = gather_full(it, mine) if g in mine else None
            if holders is not None:  # routed: only its holders get it (``_routed``)
                _routed(it, holders, tensors, g in local, mine, layout, cast(FlatBucket, out))
                continue
            if target is not None and me != target:
                if me == it.owner:
                    _send(it, tensors, target)
                continue
            if layout is not None:
                views = [view(layout.buf, layout.where[g, k], s, it.dtype) for k, s in enumerate(it.hf_shapes)]
                if tensors is not None:  # the owner (or, a ``local`` item, every rank)
                    for v, t in zip(views, tensors):
                        v.copy_(t)
                elif target is not None:  # the destination, from the owner
                    for v in views:
                        dist.recv(v, src=it.owner)
                out.extend(zip(it.hf_names, views))  # ALL_RANKS: filled by the segment broadcasts below
                continue
            tensors = _delivered(it, tensors, target)
            if it.stack is not None:
                out.extend(_stack_rows(pending, it, tensors))
            else:
                out.extend((n, t.clone() if _aliases_param(t, mine, it) else t) for n, t in zip(it.hf_names, tensors))
        if layout is not None:
            if world > 1 and targets[0] is None:  # ALL_RANKS: every rank, segment by segment
                for owner, start, end in layout.segments:
                    if owner != -1:  # -1: the ``local`` items (assembled on every rank) and routed ones
                        dist.broadcast(layout.buf[start:end], src=owner)
            cast(FlatBucket, out).flat = layout.buf
        yield out if receives else None


class _BufferLayout(NamedTuple):
    """A flat bucket's buffer and where its tensors go in it."""

    buf: torch.Tensor  # 1-D uint8, from the ``flat`` allocator
    where: dict[tuple[str, int], int]  # (global name, HF index) -> byte offset in ``buf``
    segments: list[tuple[int, int, int]]  # (owner, start, end) in ``buf``; owner -1: the ``local`` items


def _routed(
    it: _Item,
    holders: dict[int, tuple],
    tensors: list[torch.Tensor] | None,
    local: bool,
    mine: dict,
    layout: _BufferLayout | None,
    out: FlatBucket,
) -> None:
    """A routed item (``ItemRouting``): each holder puts its full tensors into its bucket buffer. The
    ranks with a full copy (its owner and ``it.copies``; every rank when ``local``) copy their own;
    the other holders, in ascending order, receive them from the copies in turn (the i-th from
    ``senders[i % len(senders)]``, ``senders = (owner, *copies)``: the sends spread over the copies,
    not all from the owner). Every rank calls this for every routed item, in plan order (only senders
    send, only holders without a copy receive)."""
    me = rdist.rank()
    senders = () if local else (it.owner, *it.copies)
    receivers = [r for r in sorted(holders) if r not in senders] if senders else []
    sender_of = {r: senders[i % len(senders)] for i, r in enumerate(receivers)}
    if tensors is None and me in it.copies and (me in holders or me in sender_of.values()):
        rule, param = mine[it.global_name]  # an expert-DP replica: its own full copy
        tensors = rule.from_shards([weight_data(param)])
    for r in receivers:
        if sender_of[r] == me:
            _send(it, tensors, r)
    if me not in holders or layout is None:
        return
    views = [view(layout.buf, layout.where[it.global_name, k], s, it.dtype) for k, s in enumerate(it.hf_shapes)]
    for k, v in enumerate(views):
        if tensors is not None:
            v.copy_(tensors[k])
        else:
            dist.recv(v, src=sender_of[me])
    out.extend(zip(it.hf_names, views))
    out.slots.update((n, holders[me]) for n in it.hf_names)


def _held(routing: ItemRouting | None, bucket: list[_Item], local: set[str], flat) -> list[dict[int, tuple] | None]:
    """Each item's holders (``ItemRouting.holders``); all None without a routing, without a buffer
    (``flat``) or in a bucket of stacked-expert rows (those travel as plain tensors to every rank)."""
    if routing is None or flat is None or any(it.stack is not None for it in bucket):
        return [None] * len(bucket)
    return [routing.holders(it, it.global_name in local) for it in bucket]


def _buffer_layout(
    bucket: list[_Item], targets: list[int | None], local: set[str], alloc, held: list[dict[int, tuple] | None]
) -> _BufferLayout | None:
    """The buffer of a bucket that this rank receives into; None when it receives nothing of the
    bucket or the bucket holds stacked-expert rows (those travel as plain tensors). With
    ``ALL_RANKS`` (``targets`` all None) one segment per owner (one broadcast each) and one (owner
    -1) of the ``local`` items and of the routed items this rank holds (``held``); else one
    gapless run."""
    me = rdist.rank()
    entries = [
        (it, k)
        for it, tg, h in zip(bucket, targets, held)
        if (me in h if h is not None else tg is None or tg == me)
        for k in range(len(it.hf_names))
    ]
    if not entries or any(it.stack is not None for it in bucket):
        return None
    every = targets[0] is None
    routed = {it.global_name for it, h in zip(bucket, held) if h is not None}
    pieces = [
        (
            (-1 if it.global_name in local or it.global_name in routed else it.owner) if every else 0,
            it.dtype.itemsize,
            tensor_bytes(it.hf_shapes[k], it.dtype),
        )
        for it, k in entries
    ]
    offsets, segments, total = flat_layout(pieces)
    where = {(it.global_name, k): o for (it, k), o in zip(entries, offsets)}
    return _BufferLayout(alloc(total, _device()), where, segments)


def _send(it: _Item, tensors: list[torch.Tensor] | None, target: int) -> None:
    """The owner's full tensors of ``it`` to rank ``target`` (``dist.send``, one per tensor)."""
    if tensors is None:
        raise RuntimeError(f"rank {rdist.rank()} owns {it.global_name} in the export plan but holds no shard of it")
    for t in tensors:
        dist.send(t.contiguous(), dst=target)


def _delivered(it: _Item, tensors: list[torch.Tensor] | None, target: int | None) -> list[torch.Tensor]:
    """Item ``it``'s full tensors on a rank that gets it: ``tensors`` on its owner (contiguous copies,
    broadcast from there, when every rank gets it: ``target`` None), else new tensors filled by
    ``dist.recv`` from the owner (``target`` is this rank) or by the owner's broadcast."""
    world = rdist.world_size()
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
    return tensors


def _gather_bucket(bucket: list[_Item], mine: dict) -> dict[str, list[torch.Tensor]]:
    """The (E)TP shards of every item of ``bucket`` this rank holds a shard of, by one all-gather
    per parallel kind (``tp``, ``etp``: first-seen order, the same on every rank) of all those
    shards packed into one buffer (each ``ALIGN``-aligned, ``flat_layout.pack_aligned``), instead
    of one all-gather per item. global name -> [shard of group rank 0, 1, ...] (views into the
    gathered buffer); groups of size 1 are left out."""
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
        offsets, total = pack_aligned([tensor_bytes(d.shape, d.dtype) for d in datas], [True] * len(datas))
        pack = torch.empty(total, dtype=torch.uint8, device=datas[0].device)
        for d, o in zip(datas, offsets):
            view(pack, o, d.shape, d.dtype).copy_(d)
        gathered = [torch.empty_like(pack) for _ in range(size)]
        dist.all_gather(gathered, pack, group=group)
        for it, d, o in zip(its, datas, offsets):
            out[it.global_name] = [view(g, o, d.shape, d.dtype) for g in gathered]
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
