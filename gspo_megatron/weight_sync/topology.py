"""Which training ranks send which weights to which engines, per sync mode (built once per run).

Each mode's :class:`~gspo_megatron.features.sync_modes.SyncMode` names its builder here
(``function(cfg, rank, engine=None, fleet=None) -> SyncTopology``); :func:`build_sync_topology` calls it.

- ``inprocess`` (the CPU transformers engine on global rank 0): the export stream assembles every
  HF tensor on rank 0, which hands the buckets to the engine object (``InProcessTransport``).
- ``colocated``: engine e shares the GPUs of training ranks ``[e*tp, (e+1)*tp)``. Every rank gets
  every full HF tensor (the owner broadcasts it), serializes it (a CUDA IPC handle on GPU, a
  shared-memory segment on CPU) and the engine's first rank hands the engine one payload per TP rank
  (``CudaIpcTransport`` over a gloo gather group per engine). Every engine gets every bucket. With
  ``rollout.sync_owner_direct`` routed experts go only to the ranks whose engine TP rank loads them,
  read on their node from the rank that holds them (``weight_sync.owner_direct``).
- ``disaggregated``: one weight-update group per pipeline stage. The stage's source rank (its first
  rank with TP = DP = CP = 0) receives the HF tensors its stage owns (from the expert-parallel and
  tensor-parallel owners of that stage, over the training fabric) and broadcasts them to every engine
  GPU (``NcclBroadcastTransport``; gloo on CPU). No byte of another stage passes through it, so what
  leaves a source is its stage's share of the model. Sources take turns per bucket (a store lock):
  engines load one update at a time.

Every rank calls :func:`build_sync_topology` (it creates process groups) and gets its
:class:`SyncTopology`: ``dst`` for ``export_hf_weights``, the owner-direct ``routing`` (its sink's,
``weight_sync.buckets``) and this rank's transport (None on ranks that send nothing).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from gspo_megatron.features.sync_modes import sync_mode
from gspo_megatron.models.weights import ALL_RANKS
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.weight_sync.buckets import ItemRouting


@dataclass
class SyncTopology:
    """mode: the sync mode; dst: export_hf_weights' destination (int, ALL_RANKS or owner -> rank);
    transport: this rank's transport or None; sources: the ranks that send (ascending);
    reconnect_all: collective, after engines were restarted (rebuilds weight-update groups);
    routing: with ``dst`` ALL_RANKS, the items some ranks only receive (``weight_sync.buckets.ItemRouting``:
    owner-direct colocated sync), or None."""

    mode: str
    dst: Any
    transport: Any
    sources: list[int] = field(default_factory=lambda: [0])
    reconnect_all: Callable[[], None] = lambda: None
    engine_urls: list[str] = field(default_factory=list)
    #: ``rollout.sync_delta`` (the same on every rank): the syncer checks the engines' weight versions first
    delta: bool = False
    routing: ItemRouting | None = None


def build_sync_topology(cfg, engine=None, fleet=None) -> SyncTopology:
    """Collective. ``engine``: the in-process engine (rank 0, inprocess mode); ``fleet``: the
    ``EngineFleet`` (every rank, SGLang modes)."""
    build = sync_mode(cfg.rollout.sync_mode).build_topology()
    return build(cfg, rdist.rank(), engine=engine, fleet=fleet)


def inprocess_topology(cfg, rank: int, engine=None, fleet=None) -> SyncTopology:
    from gspo_megatron.weight_sync.transport import InProcessTransport

    return SyncTopology(cfg.rollout.sync_mode, 0, InProcessTransport(engine) if rank == 0 else None)


def colocated_topology(cfg, rank: int, engine=None, fleet=None) -> SyncTopology:
    from gspo_megatron.weight_sync.cuda_ipc import CudaIpcTransport

    routing = owner_direct_routing(cfg, fleet) if cfg.rollout.sync_owner_direct else None
    world = dist.new_group(list(range(rdist.world_size())), backend="gloo") if routing is not None else None
    transport: CudaIpcTransport | None = None
    for spec in fleet.specs:  # every rank creates every group, in the same order
        ranks = list(spec.train_ranks)
        group = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None
        if rank in ranks:
            client = fleet.client(spec.index) if rank == spec.src_rank else None
            kw = dict(gather_group=group, gather_src=spec.src_rank, fp8=cfg.rollout.sync_fp8)
            if routing is not None:
                from gspo_megatron.weight_sync.owner_direct import OwnerDirectIpcTransport

                transport = OwnerDirectIpcTransport(
                    client, routing=routing, world_group=world, delta=cfg.rollout.sync_delta, **kw
                )
            else:
                transport = CudaIpcTransport(client, delta=cfg.rollout.sync_delta, **kw)
    return SyncTopology(
        cfg.rollout.sync_mode,
        ALL_RANKS,
        transport,
        sources=[s.src_rank for s in fleet.specs],
        engine_urls=list(fleet.urls),
        delta=cfg.rollout.sync_delta,
        routing=routing,
    )


def owner_direct_routing(cfg, fleet):
    """``rollout.sync_owner_direct``: the routing of routed experts to the engine ranks that load them
    (``weight_sync.owner_direct``). Collective (every rank's node: one all_gather_object)."""
    from gspo_megatron.engines.placement import gather_rank_infos
    from gspo_megatron.models.arch import model_hf_config
    from gspo_megatron.models.hf_config import num_experts
    from gspo_megatron.weight_sync.owner_direct import OwnerDirectRouting

    nodes = [info.node for info in gather_rank_infos()]
    return OwnerDirectRouting(fleet.specs, nodes, cfg.rollout.engine_ep, num_experts(model_hf_config(cfg)[0]))


def stage_sources() -> tuple[dict[int, int], list[int]]:
    """(pipeline stage of every global rank, source rank of every stage). Collective."""
    from megatron.core import parallel_state as ps

    me = (
        ps.get_pipeline_model_parallel_rank(),
        ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0,
    )
    everyone: list = [me]
    if rdist.world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, me)
    stage_of = {r: s for r, (s, _) in enumerate(everyone)}
    sources = [
        min(r for r, (s, cand) in enumerate(everyone) if s == stage and cand)
        for stage in range(max(stage_of.values()) + 1)
    ]
    return stage_of, sources


def disaggregated_topology(cfg, rank: int, engine=None, fleet=None) -> SyncTopology:
    from gspo_megatron.engines.placement import node_address
    from gspo_megatron.weight_sync.nccl_broadcast import NcclBroadcastTransport, StoreLock, pp_group_name

    stage_of, sources = stage_sources()
    group = dist.new_group(sources, backend="gloo") if len(sources) > 1 else None
    barrier = (lambda: dist.barrier(group=group)) if group is not None else None
    transport: Any = None
    if rank in sources and cfg.rollout.sync_delta:  # the engines' delta loader: HTTP + shared files
        from gspo_megatron.weight_sync.delta_http import DeltaHttpTransport

        stage = sources.index(rank)
        transport = DeltaHttpTransport(
            [fleet.client(e) for e in range(len(fleet.urls))],
            engine_world_sizes=fleet.world_sizes,
            full_dir=cfg.rollout.sync_delta_dir or os.path.join(cfg.output_dir, "sync_delta"),
            stage=stage,
            manage_session=stage == 0,
            barrier=barrier,
            fp8=cfg.rollout.sync_fp8,
        )
    elif rank in sources:
        stage = sources.index(rank)
        cuda = torch.cuda.is_available()
        lock = StoreLock(dist.distributed_c10d._get_default_store()) if len(sources) > 1 else None
        address = node_address()
        transport = NcclBroadcastTransport(
            [fleet.client(e) for e in range(len(fleet.urls))],
            engine_world_sizes=fleet.world_sizes,
            master_address=address,
            master_port=0,
            group_name=pp_group_name(stage),
            backend="nccl" if cuda else "gloo",
            device=None if cuda else "cpu",
            fp8=cfg.rollout.sync_fp8,
            lock=lock,
            manage_session=stage == 0,
            barrier=barrier,
            flattened=True,
        )

    def connect_all(reconnect: bool) -> None:
        # engines join one group at a time (each init blocks an engine until its rendezvous is done)
        for src in sources:
            if rank == src:
                if transport is None:  # built above for every source rank
                    raise RuntimeError(f"source rank {rank} has no weight-sync transport")
                transport.reconnect() if reconnect else transport.connect()
            if barrier is not None and rank in sources:
                barrier()

    connect_all(False)
    return SyncTopology(
        cfg.rollout.sync_mode,
        lambda owner: sources[stage_of[owner]],
        transport,
        sources=sources,
        reconnect_all=lambda: connect_all(True),
        engine_urls=list(fleet.urls),
        delta=cfg.rollout.sync_delta,
    )
