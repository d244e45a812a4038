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
  (tools/megatron_to_hf.py) and weight sync to the rollout engines. How a receiving rank assembles
  its buckets is the caller's (``sink``, a :class:`BucketSink`; the default :class:`ListSink`: plain
  lists): the weight sync passes its own (``weight_sync/buckets.py``), so this module knows no
  transport.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist

from gspo_megatron.dtypes import dtype_name, torch_dtype
from gspo_megatron.models import hf_config
from gspo_megatron.models.export_plan import _buckets, _Item, group_fused, sort_key
from gspo_megatron.models.flat_layout import pack_aligned, tensor_bytes, view
from gspo_megatron.models.mapping import Rule
from gspo_megatron.models.mtp import model_mapping
from gspo_megatron.models.param_names import global_names, named_tensors
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
    mapping = model_mapping(model)  # the family's rules (+ the MTP layer's, models/mtp.py)
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
    parallel size 1): those are the item's ``copies`` (a caller's sink may read them in place of a
    transfer from the owner; the stream itself does not use them)."""
    mapping = model_mapping(model)  # the family's rules (+ the MTP layer's, models/mtp.py)
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
    """Where an item owned by ``owner`` goes: a rank, or None for every rank (``ALL_RANKS``)."""
    if dst == ALL_RANKS:
        return None
    return dst(owner) if callable(dst) else int(dst)


class OpenBucket(Protocol):
    """One bucket being assembled on this rank (:meth:`BucketSink.open`)."""

    #: what the stream yields for the bucket on a receiving rank: (HF name, full tensor), filled by
    #: :meth:`place` and by the stream's own per-tensor delivery
    out: list[tuple[str, torch.Tensor]]
    #: False: the sink has no buffer of its own on this rank for the bucket, so no rank assembles an
    #: item from the bucket's gather but its owner (``local`` is dropped)
    buffered: bool

    def place(self, it: _Item, target: int | None, tensors: list[torch.Tensor] | None, local: bool) -> bool:
        """Deliver item ``it`` the sink's way and return True, or return False to leave it to the
        stream (``dist.send`` / ``recv`` / ``broadcast`` per tensor, appended to ``out``). ``target``:
        its destination rank (None: every rank); ``tensors``: its full HF tensors where assembled
        (owner, or every rank when ``local``), else None. Called on every rank for every item of the
        bucket, in plan order (the sink's collectives must match across ranks)."""
        ...

    def close(self) -> None:
        """After the bucket's last item, on every rank: the sink's remaining collectives."""
        ...


class BucketSink(Protocol):
    """How a rank assembles the buckets it receives: ``export_hf_weights``'s ``sink``, the caller's
    policy (the default :class:`ListSink`: plain lists; the weight sync's: ``weight_sync/buckets.py``).
    The same kind of sink on every rank: it decides the stream's collectives.

    ``bucket_gather``: a bucket's (E)TP shards travel in one all-gather per parallel kind
    (:func:`_gather_bucket`) instead of one per item (:func:`gather_full`). ``local_assembly`` (with
    ``bucket_gather`` and ``ALL_RANKS``): items of an (E)TP group that spans the whole world (e.g.
    tp = world) are assembled by every rank from that gather, with no broadcast. ``open`` is called
    once per bucket on every rank with the bucket's items, their destinations (None: every rank), the
    global names assembled on every rank (``local``) and this rank's part of the plan (``mine``:
    global name -> (rule, parameter))."""

    bucket_gather: bool
    local_assembly: bool

    def open(self, bucket: list[_Item], targets: list[int | None], local: set[str], mine: dict) -> OpenBucket: ...


class _ListBucket:
    """A :class:`ListSink` bucket: a new list, every item left to the stream."""

    buffered = False

    def __init__(self) -> None:
        self.out: list[tuple[str, torch.Tensor]] = []

    def place(self, it: _Item, target: int | None, tensors: list[torch.Tensor] | None, local: bool) -> bool:
        return False

    def close(self) -> None:
        pass


class ListSink:
    """The plain sink: every bucket a new list, every tensor delivered by the stream (HF export,
    the in-process engine)."""

    bucket_gather = False
    local_assembly = False

    def open(self, bucket: list[_Item], targets: list[int | None], local: set[str], mine: dict) -> _ListBucket:
        return _ListBucket()


@torch.no_grad()
def export_hf_weights(
    model, bucket_bytes: int = 512 << 20, plan=None, dst=0, sink: BucketSink | None = None
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

    ``sink`` (the same kind on every rank; None: :class:`ListSink`, plain lists) assembles each
    bucket (:class:`BucketSink`): a caller's sink may gather a bucket's shards at once, place the
    tensors in a buffer of its own and deliver some items to some ranks itself (the weight sync's:
    ``weight_sync/buckets.py``). What it leaves to the stream goes item by item: the owner's
    ``dist.send`` to the destination, or with ``ALL_RANKS`` its broadcasts.

    Communication per bucket, the same sequence on every rank: the (E)TP all-gathers (per item,
    :func:`gather_full`, or per bucket, :func:`_gather_bucket`, by ``sink.bucket_gather``), then item
    by item the sink's or the stream's send / recv / broadcasts, then the sink's ``close``."""
    sink = sink if sink is not None else ListSink()
    items, mine = plan if plan is not None else build_export_plan(model)
    me, world = rdist.rank(), rdist.world_size()
    pending: dict[str, dict[int, torch.Tensor]] = {}  # stacked HF tensor -> its expert rows so far
    destinations = {_destination(dst, o) for o in {it.owner for it in items}}
    receives = None in destinations or me in destinations
    # ALL_RANKS, (E)TP groups spanning the whole world (e.g. tp = world), a sink that gathers per
    # bucket and allows it: every rank has every shard of their items after the bucket's gather, so
    # each assembles them itself (no broadcast)
    whole = {
        k
        for k in ("tp", "etp")
        if sink.bucket_gather and sink.local_assembly and world > 1 and dst == ALL_RANKS and _rank_size(k)[1] == world
    }
    for bucket in _buckets(items, bucket_bytes):
        targets = [_destination(dst, it.owner) for it in bucket]
        shards = _gather_bucket(bucket, mine) if sink.bucket_gather else {}
        local = {g for g in shards if mine[g][0].parallel in whole}
        into = sink.open(bucket, targets, local, mine)
        if not into.buffered:
            local = set()  # no buffer: only the owner assembles, and sends or broadcasts per tensor
        for it, target in zip(bucket, targets):
            g = it.global_name
            if g in shards:
                tensors = mine[g][0].from_shards(shards[g]) if me == it.owner or g in local else None
            else:
                tensors = gather_full(it, mine) if g in mine else None
            if into.place(it, target, tensors, g in local):
                continue
            if target is not None and me != target:
                if me == it.owner:
                    send_full(it, tensors, target)
                continue
            tensors = _delivered(it, tensors, target)
            if it.stack is not None:
                into.out.extend(_stack_rows(pending, it, tensors))
            else:
                into.out.extend(
                    (n, t.clone() if _aliases_param(t, mine, it) else t) for n, t in zip(it.hf_names, tensors)
                )
        into.close()
        yield into.out if receives else None


def send_full(it: _Item, tensors: list[torch.Tensor] | None, target: int) -> None:
    """The owner's full tensors of ``it`` (HF shapes ``it.hf_shapes``) to rank ``target``
    (``dist.send``, one per tensor); ``target`` receives them with ``dist.recv`` in the same order."""
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
