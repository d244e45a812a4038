"""The weight sync's side of the export stream's buckets (``models.weights.export_hf_weights``'s
``sink``): where a receiving rank puts each bucket's tensors and which ranks receive which items.
The stream gathers TP / EP shards and delivers full HF tensors; the transports' policy is here.

- :class:`BucketBuffer`: one reused uint8 buffer (grown to the largest bucket; in shared memory for
  colocated engines on CPU), the allocator ``(nbytes, device) -> uint8 [nbytes]``.
- :class:`FlatBucket`: a bucket (list of (HF name, tensor)) whose tensors are views into that buffer
  (``flat``), so a transport sends the buffer as it is (one broadcast, or sglang's
  ``flattened_bucket`` payload) instead of flattening the tensors again; with a routing, also what
  each rank serves with its tensors (``slots``) and every item's holders (``routes``).
- :class:`ItemRouting`: sends some items to some ranks only (owner-direct colocated sync:
  ``weight_sync.owner_direct.OwnerDirectRouting``); every other item goes to every rank.
- :class:`FlatBucketSink`: the sink (``models.weights.BucketSink``) built from an allocator and an
  optional routing (``weight_sync.sync.WeightSyncer``, the SGLang sync modes).

With an allocator the stream gathers a bucket's (E)TP shards in one all-gather per parallel kind,
and every receiving rank gets the bucket as a :class:`FlatBucket` (buckets holding stacked-expert
rows excepted: those travel as plain tensors): the owner copies an item into the buffer, a single
destination ``dist.recv``-s it, and with ``ALL_RANKS`` the owners broadcast the buffer one segment
per owner (one broadcast per owner per bucket instead of one per tensor). The buffer's byte layout:
``models/flat_layout.py``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch
import torch.distributed as dist

from gspo_megatron.models.export_plan import _Item
from gspo_megatron.models.flat_layout import flat_layout, tensor_bytes, view
from gspo_megatron.models.weights import send_full, weight_data
from gspo_megatron.runtime import distributed as rdist

Holders = dict[int, tuple]  # holder rank -> what it serves with the item (opaque here)


class ItemRouting(Protocol):
    """Which ranks receive an item (:class:`FlatBucketSink`'s ``routing``; owner-direct colocated sync:
    ``weight_sync.owner_direct.OwnerDirectRouting``); used with ``ALL_RANKS``.

    ``holders(item, local)`` -> None (every rank gets it), or {rank: what the rank serves with it}:
    the ranks that hold the item's full tensors in their bucket (the owner copies them, the others
    receive them from the owner or its copies by ``dist.send`` / ``dist.recv``; ``local``: every
    rank assembles the item itself from the bucket's (E)TP gather, so no transfer is needed). The
    values are opaque here and come back to the transport in the bucket's ``FlatBucket.slots``.
    Must be the same on every rank."""

    def holders(self, item: _Item, local: bool) -> Holders | None: ...


class FlatBucket(list):
    """A bucket (list of (HF name, tensor)) whose tensors are views into one uint8 buffer ``flat``
    (:class:`FlatBucketSink`): a transport can send ``flat`` as it is (one broadcast, or sglang's
    ``flattened_bucket`` payload) instead of flattening the tensors again. The views are
    element-aligned; ``byte_offset(t)`` is a tensor's place in ``flat``. They are valid until the
    stream's next bucket is requested (the buffer is reused)."""

    flat: torch.Tensor  # unset when the rank receives nothing of a routed bucket (or it has stacked rows)
    # with an ``ItemRouting``: HF name -> what this rank serves with it (names not in it: the rank's own),
    # and every item's holders in the bucket (None: every rank), the same on every rank
    slots: dict[str, tuple]
    routes: list[Holders | None]

    def __init__(self, *args):
        super().__init__(*args)
        self.slots = {}
        self.routes = []

    def byte_offset(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.flat.data_ptr()


class BucketBuffer:
    """One reusable uint8 buffer for :class:`FlatBucketSink`, grown to the largest bucket;
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


class FlatBucketSink:
    """``export_hf_weights``'s sink for the weight sync (``models.weights.BucketSink``; the same on
    every rank).

    alloc: ``(nbytes, device) -> uint8 [nbytes]`` (e.g. :class:`BucketBuffer`), or None: no buffer
    (the stream's plain per-tensor delivery; buckets still come as :class:`FlatBucket` when there is
    a routing, with no holders). routing: an :class:`ItemRouting`, or None: every item to the
    stream's destinations. Under a routing no item is assembled by every rank from the bucket's
    gather (``local_assembly`` off): its owner assembles it and sends it to its holders, so the
    stream asks ``routing.holders`` with ``local`` False only."""

    def __init__(
        self, alloc: Callable[[int, torch.device], torch.Tensor] | None = None, routing: ItemRouting | None = None
    ):
        self.alloc = alloc
        self.routing = routing
        self.bucket_gather = alloc is not None
        self.local_assembly = alloc is not None and routing is None

    def open(self, bucket: list[_Item], targets: list[int | None], local: set[str], mine: dict) -> _OpenFlatBucket:
        held = _held(self.routing, bucket, local, self.alloc)
        layout = _buffer_layout(bucket, targets, local, self.alloc, held) if self.alloc is not None else None
        return _OpenFlatBucket(bucket, targets, held, layout, mine, self.routing is not None)


class _BufferLayout(NamedTuple):
    """A flat bucket's buffer and where its tensors go in it."""

    buf: torch.Tensor  # 1-D uint8, from the allocator
    where: dict[tuple[str, int], int]  # (global name, HF index) -> byte offset in ``buf``
    segments: list[tuple[int, int, int]]  # (owner, start, end) in ``buf``; owner -1: the ``local`` items


class _OpenFlatBucket:
    """One bucket of :class:`FlatBucketSink` on this rank (``models.weights.OpenBucket``): ``out`` is
    a :class:`FlatBucket` when the rank has a buffer for it or there is a routing, else a plain list."""

    def __init__(
        self,
        bucket: list[_Item],
        targets: list[int | None],
        held: list[Holders | None],
        layout: _BufferLayout | None,
        mine: dict,
        routed: bool,
    ):
        self.layout = layout
        self.mine = mine
        self.every = targets[0] is None  # ALL_RANKS (the same for every item of a bucket)
        self.holders = {it.global_name: h for it, h in zip(bucket, held)}
        self.buffered = layout is not None
        self.out: list[tuple[str, torch.Tensor]] = FlatBucket() if layout is not None or routed else []
        if routed:
            self._flat().routes = held

    def _flat(self) -> FlatBucket:
        if not isinstance(self.out, FlatBucket):
            raise TypeError("a plain bucket has no buffer")
        return self.out

    def place(self, it: _Item, target: int | None, tensors: list[torch.Tensor] | None, local: bool) -> bool:
        """A routed item: to its holders (:func:`_routed`). Else, on a rank that receives it into the
        buffer: the owner's (or, ``local``, every rank's) copy, a single destination's ``dist.recv``;
        with ``ALL_RANKS`` the other ranks get it by :meth:`close`'s segment broadcasts. Anything else
        (no buffer; a rank that only sends): the stream's."""
        holders = self.holders[it.global_name]
        if holders is not None:
            _routed(it, holders, tensors, local, self.mine, self.layout, self._flat())
            return True
        layout = self.layout
        if layout is None or (target is not None and target != rdist.rank()):
            return False
        views = [view(layout.buf, layout.where[it.global_name, k], s, it.dtype) for k, s in enumerate(it.hf_shapes)]
        if tensors is not None:  # the owner (or, a ``local`` item, every rank)
            for v, t in zip(views, tensors):
                v.copy_(t)
        elif target is not None:  # the destination, from the owner
            for v in views:
                dist.recv(v, src=it.owner)
        self.out.extend(zip(it.hf_names, views))  # ALL_RANKS: filled by the segment broadcasts (close)
        return True

    def close(self) -> None:
        """With ``ALL_RANKS``: one broadcast per owner segment of the buffer (every rank)."""
        if self.layout is None:
            return
        if rdist.world_size() > 1 and self.every:
            for owner, start, end in self.layout.segments:
                if owner != -1:  # -1: the ``local`` items (assembled on every rank) and routed ones
                    dist.broadcast(self.layout.buf[start:end], src=owner)
        self._flat().flat = self.layout.buf


def _routed(
    it: _Item,
    holders: Holders,
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
            send_full(it, tensors, r)
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


def _held(routing: ItemRouting | None, bucket: list[_Item], local: set[str], alloc) -> list[Holders | None]:
    """Each item's holders (``ItemRouting.holders``); all None without a routing, without a buffer
    (``alloc``) or in a bucket of stacked-expert rows (those travel as plain tensors to every rank)."""
    if routing is None or alloc is None or any(it.stack is not None for it in bucket):
        return [None] * len(bucket)
    return [routing.holders(it, it.global_name in local) for it in bucket]


def _buffer_layout(
    bucket: list[_Item], targets: list[int | None], local: set[str], alloc, held: list[Holders | None]
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
    return _BufferLayout(alloc(total, rdist.device()), where, segments)
