"""The session's construction: every rank composes its :class:`~gspo_megatron.orchestration.session.RolloutSession`
once from the config (what each enabled component adds: adapter sync's syncer, bounded staleness's
overlap, offload's state offloader, the sync probe), and nothing of it is replaced afterwards.
``train.build_rollout_side`` calls :func:`build_session` after the engines are built."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any, Callable, Protocol

from gspo_megatron.features.adapter_sync import ADAPTER_SYNC
from gspo_megatron.features.inflight import INFLIGHT
from gspo_megatron.features.sync_modes import sync_mode
from gspo_megatron.orchestration.async_producer import build_overlap
from gspo_megatron.orchestration.batch import collect_rollouts
from gspo_megatron.orchestration.colocation import Colocation
from gspo_megatron.orchestration.probe import SyncVerifier, default_tolerance
from gspo_megatron.orchestration.session import RolloutSession, SyncCollector
from gspo_megatron.weight_sync.lora_adapter import AdapterSyncer
from gspo_megatron.weight_sync.sync import WeightSyncer

if TYPE_CHECKING:
    from gspo_megatron.config import Config


class SessionParts(Protocol):
    """What :func:`build_session` reads of the run being built (``train.Run`` has these; rank 0 alone
    holds the dataset, sampler, tokenizer and rewards, None elsewhere) and the two fields it sets."""

    rank: int
    model: Any
    ddp: Any
    optimizer: Any
    rollout: Any  # factory.RolloutSide: engine, topology, dead_engines, restart
    dataset: Any
    sampler: Any
    tokenizer: Any
    rewards: Any
    start_step: int
    pad_id: int
    overlap: Any
    offloader: Any
    teachers: Any  # rank 0's distill.teachers.TeacherPool, or None


def build_session(cfg: Config, run: SessionParts, after_sync: Callable[[Any], None] | None = None) -> RolloutSession:
    """Every rank: the ``RolloutSession`` composed once from what the config asks (nothing of it is
    replaced later); sets ``run.overlap``.

    - collector: rank 0's synchronous rollout (``orchestration.batch.collect_rollouts``), or with
      ``rollout.max_staleness`` >= 1 the overlap (rank 0 generates the next batches while every rank
      trains), which also brackets every sync (``orchestration.async_producer``); with
      ``rollout.inflight_updates`` its producer keeps the engines generating through every sync
      (``orchestration.inflight``);
    - colocation: colocated engines release their memory after each rollout and take it back around
      the sync; ``rollout.offload_train``: the training state leaves the devices while the engines
      generate (``run.offloader``, a ``trainer.offload.TrainStateOffloader`` built with the trainer so
      that its host memory is reserved while the engines start), and a sync inside a rollout (engine
      restarted) brings it back for the push (``orchestration.colocation``);
    - verifier: ``rollout.sync_verify``: the weight version every sync; the log-prob probe on sync 1
      and every ``rollout.sync_verify_every``-th (``orchestration.probe.SyncVerifier``)."""
    rollout = run.rollout
    assert rollout is not None, "build_session needs the engines (factory.build_engines) first"
    engine = rollout.engine
    syncer: WeightSyncer
    if ADAPTER_SYNC.enabled(cfg):  # only the adapters per sync
        adapter_dir = None
        if not sync_mode(cfg.rollout.sync_mode).colocated or cfg.rollout.engine_urls:  # a PEFT directory they read
            adapter_dir = cfg.rollout.lora_adapter_dir or os.path.join(cfg.output_dir, "lora_adapters")
        syncer = AdapterSyncer(
            run.model, rollout.topology, cfg.rollout.sync_bucket_mb, engine=engine, adapter_dir=adapter_dir
        )
    else:
        syncer = WeightSyncer(run.model, rollout.topology, cfg.rollout.sync_bucket_mb)
    collector = None
    if run.rank == 0:
        dataset, sampler, tokenizer, rewards, teachers = (
            run.dataset,
            run.sampler,
            run.tokenizer,
            run.rewards,
            run.teachers,
        )
        collector = SyncCollector(
            lambda step: collect_rollouts(cfg, step, engine, dataset, sampler, tokenizer, rewards, teachers), sampler
        )
    inflight = None
    if run.rank == 0 and INFLIGHT.enabled(cfg):  # engines that never drain (orchestration/inflight.py)
        from gspo_megatron.orchestration.inflight import InflightProducer

        parts = (engine, run.dataset, run.sampler, run.tokenizer, run.rewards)
        inflight = functools.partial(InflightProducer, cfg, *parts, start_step=run.start_step, teachers=run.teachers)
    run.overlap = build_overlap(cfg, run.model, syncer, collector, run.start_step, inflight=inflight)
    # started teachers release their memory while the student trains, unless a producer keeps
    # generating (and scoring) through training (the overlap, in-flight updates)
    teachers = run.teachers if run.overlap is None else None
    colocation = Colocation(
        engine, colocated=sync_mode(cfg.rollout.sync_mode).colocated, offloader=run.offloader, teachers=teachers
    )
    verifier = None
    if cfg.rollout.sync_verify:
        probe_prompts = None
        if run.rank == 0:
            dataset = run.dataset
            assert dataset is not None  # rank 0 holds the dataset
            probe_prompts = [dataset[i].prompt_ids for i in range(min(4, len(dataset)))]
        verifier = SyncVerifier(
            run.model,
            cfg.rollout.sync_verify_tol or default_tolerance(cfg.model.dtype, cfg.rollout.sync_fp8),
            run.pad_id,
            every=cfg.rollout.sync_verify_every,
            routing_replay=cfg.rollout.routing_replay,
            probe_prompts=probe_prompts,
        )
    overlap = run.overlap
    return RolloutSession(
        syncer,
        engine,
        overlap if overlap is not None else collector,
        max_restarts=cfg.rollout.max_engine_restarts,
        dead_engines=rollout.dead_engines,
        restart=rollout.restart,
        colocation=colocation,
        verifier=verifier,
        sync_hooks=[overlap.around_sync] if overlap is not None else [],
        after_sync=after_sync,
    )
