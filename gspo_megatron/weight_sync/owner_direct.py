"""Owner-direct colocated sync (``rollout.sync_owner_direct``): routed expert weights go from the
rank that owns them to the engine TP ranks that load them, on their own node by CUDA IPC (shared
memory on CPU), instead of a world broadcast that gives every training rank the whole model.

Plain colocated sync (``weight_sync.cuda_ipc``): the export stream's owner of each tensor broadcasts
it to every training rank, and each rank hands its engine TP rank (same GPU) the whole bucket. For an
MoE model most bytes are routed experts, and an engine TP rank needs only some of them: with
sglang's expert parallelism (``rollout.engine_ep`` = ``--ep-size``) engine TP rank i holds experts
``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``, ``ep_rank = i // (engine_tp / engine_ep)`` (sglang 0.5.23
``layers/moe/fused_moe_triton/layer.py``: ``_map_global_expert_id_to_local_expert_id`` skips any other
expert on load; ``cpu_server/sharding.py`` restates it). With ``engine_ep = 1`` every engine
TP rank needs every expert (it keeps its slice of each), but it can read it from any process on its
node.

Routing (:class:`OwnerDirectRouting`, the export stream's sink's routing; ``weight_sync.buckets.ItemRouting``):
a routed expert tensor (HF name ``...experts.<e>....``, not stacked rows) is held, on each node that
has a training rank whose engine TP rank (its "slot": engine, TP rank) needs it, by one rank: its
export owner when the owner is on that node, else an expert-DP replica on that node that holds it
whole (``_Item.copies``: expert tensor parallel size 1; it copies from its own parameter), else one
of the node's ranks that need it (``needers[expert % len(needers)]``: the copies a node receives
spread over its ranks and their NICs), which receives it by ``dist.send`` / ``dist.recv`` (the
only network bytes, one copy per node that has neither) from one of the ranks with a full copy,
the i-th receiving holder (ascending) from ``(owner, *copies)[i % count]`` (``weight_sync.buckets._routed``:
the sends spread over the replicas instead of all leaving the owner). Every other tensor (attention, norms, embeddings, shared experts, routers) goes to
every rank as before. Items every rank assembles itself from the bucket's TP gather are held by each
rank that needs them (no transfer).

Transport (:class:`OwnerDirectIpcTransport`): each rank describes its bucket buffer once per slot it
serves: its own slot (the tensors every rank gets, and the experts its engine rank needs that it
holds) and the slots of other ranks on its node whose experts it holds (same buffer, a metadata
subset: sglang's ``flattened_bucket`` payload ``{"flattened_tensor", "metadata"}``, one CUDA IPC
handle). The payload lists go to every engine's first rank (one ``all_gather_object`` over a gloo
group of the world), which calls ``update_weights_from_tensor`` once per round: round r gives engine
TP rank i the r-th payload meant for it (its own rank's first), or, when fewer holders serve it than
the engine has rounds, an empty one (no tensors) made by the rank on its own GPU. Every rank knows
the rounds from the bucket's routes (``FlatBucket.routes``); each payload string is opened exactly
once (torch's shared-memory segments and CUDA IPC handles are reference-counted per serialization;
sglang's ``tp_worker.deserialize_own_rank`` says the same), so an empty payload is made per use.
sglang loads each TP rank's payload independently
(``weight_updater.update_weights_from_tensor`` -> ``_update_weights_from_flattened_bucket`` ->
``model.load_weights``), so TP ranks may get different tensors in one call. A barrier over the world
after each bucket keeps every holder's buffer alive until every engine loaded it.

On GPUs an engine TP rank opens buffers of other GPUs of its node (sglang's
``monkey_patch_torch_reductions`` maps the sender's device by UUID), so every GPU of the node must be
visible to the engines: the engines the trainer launches inherit the training rank's environment
and pick their GPUs by ``--base-gpu-id`` (a per-task ``CUDA_VISIBLE_DEVICES`` would hide the others).

With ``rollout.sync_delta`` every rank encodes what it serves (its own :class:`DeltaEncoder`, a host
copy of the tensors every rank gets and of the routed ones it holds) and each slot's payload is the
plain list of its tensors' wire entries, loaded by the delta loader (``weight_sync.delta_loader``,
sglang's ``--custom-weight-loader`` route) instead of ``flattened_bucket``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.engines.sglang_compat import (
    flattened_bucket_class,
    flattened_metadata_class,
    multiprocessing_serializer,
    patch_torch_reductions,
)
from gspo_megatron.models.registry import expert_weight
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.weight_sync.cuda_ipc import CudaIpcTransport, view_metadata
from gspo_megatron.weight_sync.delta import DeltaEncoder, DeltaStats
from gspo_megatron.weight_sync.fp8_quant import SCALE_SUFFIX, quantize_bucket_fp8

Slot = tuple[int, int]  # (engine index, engine TP rank)


class OwnerDirectRouting:
    """Which ranks hold each routed expert tensor and which slots they serve with it (module docstring).

    specs: the colocated engines (``engines.placement.EngineSpec``: ``index``, ``train_ranks``);
    nodes: the node of every global rank; engine_ep: sglang's ``--ep-size``; num_experts: routed
    experts per MoE layer (the HF config's). The same object on every rank."""

    def __init__(self, specs: Sequence[Any], nodes: Sequence[int], engine_ep: int, num_experts: int):
        self.slot_of: dict[int, Slot] = {}
        for spec in specs:
            tp = len(spec.train_ranks)
            if engine_ep < 1 or tp % engine_ep:
                raise ValueError(f"rollout.engine_ep={engine_ep} must divide rollout.engine_tp={tp}")
            for i, r in enumerate(spec.train_ranks):
                self.slot_of[r] = (spec.index, i)
        if num_experts and num_experts % engine_ep:
            raise ValueError(
                f"rollout.engine_ep={engine_ep} must divide the model's {num_experts} routed experts "
                "(sglang asserts it)"
            )
        self.tp = {spec.index: len(spec.train_ranks) for spec in specs}
        self.nodes = list(nodes)
        self.ep = engine_ep
        self.num_experts = num_experts
        # holders per (item, local): the same every sync (the plan is fixed), asked for every item of
        # every sync, and O(world) to work out
        self._holders: dict[tuple[str, bool], dict[int, tuple[Slot, ...]] | None] = {}

    def needs(self, rank: int, expert: int) -> bool:
        """Whether the engine TP rank on ``rank``'s GPU loads routed expert ``expert``."""
        engine, i = self.slot_of[rank]
        if self.ep == 1:
            return True
        per_ep = self.num_experts // self.ep
        ep_rank = i // (self.tp[engine] // self.ep)
        return ep_rank * per_ep <= expert < (ep_rank + 1) * per_ep

    def expert_of(self, item) -> int | None:
        """The routed expert an export item belongs to; None for everything else (stacked rows too)."""
        if item.stack is not None or not self.num_experts:
            return None
        found = expert_weight(item.hf_names[0])
        return None if found is None else found[0]

    def holders(self, item, local: bool) -> dict[int, tuple[Slot, ...]] | None:
        """``weight_sync.buckets.ItemRouting.holders``: None (every rank) for all but routed experts;
        for those {holder rank: the slots it serves}. Worked out once per item of the (fixed) plan."""
        key = (item.global_name, local)
        if key not in self._holders:
            self._holders[key] = self._work_out_holders(item, local)
        return self._holders[key]

    def _work_out_holders(self, item, local: bool) -> dict[int, tuple[Slot, ...]] | None:
        expert = self.expert_of(item)
        if expert is None:
            return None
        needers = [r for r in sorted(self.slot_of) if self.needs(r, expert)]
        if local:
            return {r: (self.slot_of[r],) for r in needers}
        by_node: dict[int, list[int]] = {}
        for r in needers:
            by_node.setdefault(self.nodes[r], []).append(r)
        out: dict[int, list[Slot]] = {}
        for node, ranks in by_node.items():
            near = [c for c in (item.owner, *item.copies) if self.nodes[c] == node]
            # else one of the node's needing ranks, by expert index: the copies a node receives spread
            # over its ranks (their NICs) instead of all entering through one
            holder = near[0] if near else ranks[expert % len(ranks)]
            out.setdefault(holder, []).extend(self.slot_of[r] for r in ranks)
        return {h: tuple(s) for h, s in out.items()}


class OwnerDirectIpcTransport(CudaIpcTransport):
    """The colocated transport for an owner-direct routed stream (module docstring).

    routing: the run's :class:`OwnerDirectRouting`; world_group: a gloo group of every training
    rank; ``client`` / ``gather_src`` / ``gather_group`` / ``fp8`` / ``manage_session`` as
    :class:`CudaIpcTransport` (the engine's first rank talks to it; sessions unchanged)."""

    def __init__(self, client: Any = None, *, routing: OwnerDirectRouting, world_group: Any, **kw: Any):
        self._bucket_cls: Any = flattened_bucket_class()
        if self._bucket_cls is None or flattened_metadata_class() is None:
            raise ImportError("rollout.sync_owner_direct needs sglang's FlattenedTensorBucket (sglang >= 0.5)")
        super().__init__(client, **kw)
        self.routing = routing
        self.world = world_group
        self.slot = routing.slot_of[self.rank]
        if self.delta:  # every rank encodes what it serves (``CudaIpcTransport`` made one on src only)
            self.encoder = DeltaEncoder()
        else:
            self.load_format = "flattened_bucket"
        self._keep: list[torch.Tensor] = []  # this bucket's payload tensors made here (empty buffers, deltas)

    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        rounds, mine = self._rounds(bucket)
        payloads = [(s, p, False) for s, p in self._payloads(bucket)]
        payloads += [(self.slot, self._empty_payload(), True) for _ in range(rounds[self.slot] - mine)]
        everyone: list = [None] * dist.get_world_size(self.world)
        dist.all_gather_object(everyone, payloads, group=self.world)
        if self.is_src:
            engine = self.slot[0]
            per_rank = []
            for r, slot in sorted(self.routing.slot_of.items()):
                if slot[0] != engine:
                    continue
                mine_first = sorted(range(len(everyone)), key=lambda h: (h != r, h))
                got = [p for h in mine_first for s, p, empty in everyone[h] if s == slot and not empty]
                got += [p for s, p, empty in everyone[r] if s == slot and empty]
                if len(got) != rounds[slot]:
                    raise RuntimeError(
                        f"owner-direct sync: engine {engine} TP rank {slot[1]} got {len(got)} payloads for "
                        f"{rounds[slot]} rounds (the ranks disagree on the bucket's routing)"
                    )
                per_rank.append(got)
            for k in range(max(rounds.values(), default=0)):
                self._update([got[k] for got in per_rank])
        dist.barrier(group=self.world)  # holders keep their buffers until every engine loaded
        self._keep.clear()
        del payloads, everyone
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def delta_metrics(self) -> dict[str, float]:
        """The delta-sync totals of the last sync, summed over every training rank (each encodes only
        what it serves: the tensors every rank gets, for its own engine TP rank, and the routed
        experts it holds, once for all the slots it serves them to), so ``sync/delta_full_bytes``
        equals ``sync/bytes_total``. One gloo all-reduce: every rank calls it (``WeightSync.sync``)."""
        if self.encoder is None:
            return {}
        s = self.encoder.stats
        counts = [s.full_bytes, s.wire_bytes, s.elements, s.changed, *s.encodings.values()]
        total = torch.tensor(counts, dtype=torch.float64)
        dist.all_reduce(total, group=self.world)
        full, wire, elements, changed, *kinds = (int(v) for v in total.tolist())
        return DeltaStats(full, wire, elements, changed, dict(zip(s.encodings, kinds))).metrics()

    def _rounds(self, bucket) -> tuple[dict[Slot, int], int]:
        """({slot of this rank's engine: engine calls of the bucket}, payloads this rank's slot gets
        from the bucket's holders): the same on every rank, from the bucket's routes. A slot is served
        by its own rank when the bucket has tensors every rank gets, and by each rank that holds
        routed tensors for it; the engine is called as often as its most served slot."""
        routes = getattr(bucket, "routes", None)
        if routes is None:
            raise TypeError(
                "OwnerDirectIpcTransport needs the export stream's routed buckets (weight_sync.buckets.FlatBucket)"
            )
        engine = self.slot[0]
        served: dict[Slot, set[int]] = {s: set() for s in self.routing.slot_of.values() if s[0] == engine}
        every = any(h is None for h in routes)
        for r, s in self.routing.slot_of.items():
            if s in served and every:
                served[s].add(r)
        for holders in routes:
            for h, slots in (holders or {}).items():
                for s in slots:
                    if s in served:
                        served[s].add(h)
        counts = {s: len(hs) for s, hs in served.items()}
        rounds = max(counts.values(), default=0)
        return {s: rounds for s in counts}, counts[self.slot]

    def _payloads(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[Slot, str]]:
        """(slot, payload) for every slot this rank serves in ``bucket``: one buffer, described per slot
        (with ``delta``: each slot's tensors' encoded entries, a plain list for the delta loader)."""
        slots: dict[str, tuple[Slot, ...]] = dict(getattr(bucket, "slots", {}))
        flat = getattr(bucket, "flat", None)
        if self.fp8:
            bucket = quantize_bucket_fp8(bucket)
            flat = None
        if not bucket:
            return []
        serve: dict[Slot, list[int]] = {}
        for j, (name, _) in enumerate(bucket):
            base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) and name not in slots else name
            for s in slots.get(base, (self.slot,)):
                serve.setdefault(s, []).append(j)
        if self.delta:
            return self._delta_payloads_per_slot(bucket, serve)
        if flat is None:  # fp8 (new tensors) or a plain list: one flattened copy, described per slot
            order = sorted(range(len(bucket)), key=lambda j: -bucket[j][1].element_size())  # element-aligned
            flat = self._bucket_cls(named_tensors=[(bucket[j][0], bucket[j][1].detach().contiguous()) for j in order])
            meta = dict(zip(order, flat.get_metadata()))
            flat = flat.get_flattened_tensor()
        else:
            meta = {j: view_metadata(name, t, flat) for j, (name, t) in enumerate(bucket)}
        patch_torch_reductions([flat])
        ser = multiprocessing_serializer()
        return [
            (s, ser.serialize({"flattened_tensor": flat, "metadata": [meta[j] for j in js]}, output_str=True))
            for s, js in serve.items()
        ]

    def _delta_payloads_per_slot(self, bucket, serve: dict[Slot, list[int]]) -> list[tuple[Slot, str]]:
        """Encoding at the holders: this rank's encoder keeps the copy of every tensor it serves (the
        routing is the same every sync, so each engine TP rank's copy of a tensor is always updated
        from the same holder's); each tensor is encoded once and its entries go to every slot it
        serves, after the encoder's epoch (``weight_sync.delta`` wire format; the engine keeps an
        epoch per tensor, so holders' epochs may differ)."""
        if self.encoder is None:
            raise RuntimeError("OwnerDirectIpcTransport: delta without an encoder")
        device = bucket[0][1].device
        encoded = []
        for name, t in bucket:
            epoch, *entries = self.encoder.encode_bucket([(name, t)])
            encoded.append([(n, e if e.device == device else e.to(device)) for n, e in entries])
        epoch = (epoch[0], epoch[1].to(device))
        ser = multiprocessing_serializer()
        out = []
        for s, js in serve.items():
            entries = [epoch, *(e for j in js for e in encoded[j])]
            entries = [(n, t.detach().contiguous()) for n, t in entries]
            self._keep.extend(t for _, t in entries)
            patch_torch_reductions([t for _, t in entries])
            out.append((s, ser.serialize(entries, output_str=True)))
        return out

    def _empty_payload(self) -> str:
        """A payload of no tensors, made anew for each use: torch shares even an empty CPU tensor as a
        shared-memory segment (a CUDA one by IPC handle), reference-counted per serialization and
        released by each open, so one payload string opened twice frees the segment under a later
        reader (``unable to open shared memory object``). Kept alive until the bucket's barrier.
        With ``delta``: an empty list (the delta loader's ``apply_deltas`` loads nothing)."""
        if self.delta:
            return multiprocessing_serializer().serialize([], output_str=True)
        one = torch.zeros(1, dtype=torch.uint8, device=rdist.device())
        self._keep.append(one)
        patch_torch_reductions([one])
        return multiprocessing_serializer().serialize({"flattened_tensor": one, "metadata": []}, output_str=True)
