"""Push the trainer's current weights to the rollout engine(s) after an optimizer step.

Every rank calls :meth:`WeightSyncer.sync`: the export stream (``models.weights.export_hf_weights``)
gathers TP / EP / PP shards and renames them to the HF layout, routed by the run's
``weight_sync.topology`` (rank 0, every rank, or each pipeline stage's source) and assembled by this
module's sink (``weight_sync.buckets.FlatBucketSink``: the SGLang modes' reused flat buffer, the
owner-direct routing); every rank that holds a transport sends the buckets it receives. The same
stream writes HF checkpoints, so what the engines get is exactly what an export would contain.

A transport failure (a dead engine) never leaves the other ranks stuck in the export collectives:
the failing rank keeps iterating the stream without sending, and after the stream every rank learns
whether any rank failed (one all-gather, which also carries the byte counts); the error texts are
gathered on rank 0, which decides (``orchestration.session``).

Delta sync (``rollout.sync_delta``): before encoding, the ranks that talk to engines ask each engine
the version of the weights it serves (``/model_info``'s ``weight_version``, set by every update call);
an engine that does not report the last sync's version was restarted (sglang starts at ``default``)
or written by someone else, so it holds no base for a delta, and every rank's encoder starts over
(a full sync under a new epoch, one all-gather of the flag). The engine's loader raising instead
(``delta_loader``) would end a real engine: sglang's weight updater has no handler around a custom
loader (``model_runner_components/weight_updater.py``), its scheduler exits on the exception.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from gspo_megatron.features.sync_modes import sync_mode
from gspo_megatron.models.lora import adapter_nbytes
from gspo_megatron.models.weights import build_export_plan, export_hf_weights
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.weight_sync.buckets import BucketBuffer, FlatBucketSink


class WeightSyncer:
    """Caches the export plan (one all_gather_object), numbers the syncs (the weight version the
    engines report) and times each sync (the one timing path: the transports do not time)."""

    def __init__(self, model, topology, bucket_mb: float = 512.0):
        self.model = model
        self.topology = topology
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.plan = build_export_plan(model)
        # SGLang modes: every bucket arrives as views into one reused buffer (``FlatBucket``), which
        # the transports send as it is (no flattening copy, one broadcast per bucket); colocated on
        # CPU it lives in shared memory, so the engines map it instead of the serializer copying it.
        # The same on every rank (it changes the export's collectives).
        mode = getattr(topology, "mode", None)
        spec = sync_mode(mode) if mode is not None else None
        self.bucket_buffer = BucketBuffer(share=spec.colocated) if spec is not None and spec.flat_buckets else None
        # model.lora: what an adapter-only sync would send (every adapter once, unsharded)
        self.lora_bytes = adapter_nbytes(model) if _lora_of(model) else 0
        self.version = 0
        self.errors: list[str] = []  # on rank 0 after a failed sync: one text per failing rank

    def sync(self) -> dict:
        """Collective. Returns the sync metrics; ``self.errors`` (rank 0) is non-empty on failure."""
        t0 = time.perf_counter()
        rank = rdist.rank()
        transport = self.topology.transport
        self.version += 1
        error: BaseException | None = None
        nbytes, nbuckets, bucket_times = 0, 0, []

        def guard(fn, *args) -> None:
            nonlocal error
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - reported to every rank after the stream
                error = e

        rebased = self._forget_restarted_engines(transport) if getattr(self.topology, "delta", False) else None
        if transport is not None:
            guard(transport.begin, str(self.version))
        # a transport whose ranks run collectives per bucket (``keeps_step``) is called for every
        # bucket even after a failure; the others stop sending at the first one
        keeps_step = getattr(transport, "keeps_step", False)
        # (and, its ranks' buckets differing under an owner-direct routing, even with an empty one)
        for bucket in export_hf_weights(
            self.model, self.bucket_bytes, plan=self.plan, dst=self.topology.dst, sink=self._sink()
        ):
            if bucket is None or transport is None or ((not bucket or error is not None) and not keeps_step):
                continue
            tb = time.perf_counter()
            guard(transport.send_bucket, bucket)
            bucket_times.append(time.perf_counter() - tb)
            nbuckets += 1 if bucket else 0
            nbytes += bucket_nbytes(bucket)
        if transport is not None and (error is None or keeps_step):
            guard(transport.end)
        # one collective for the failure flag and the byte counts (was three)
        failed, most, total = _failed_and_bytes(error is not None, float(nbytes))
        if failed:  # delta sync: the engines may hold anything now, the next sync is full
            self.engines_restarted()
        self.errors = []
        if failed:
            texts = _gather_to_rank0(f"rank {rank}: {type(error).__name__}: {error}" if error else None)
            self.errors = [t for t in texts if t] if rank == 0 else []
        delta = getattr(transport, "delta_metrics", None)
        return {
            "sync/total_s": time.perf_counter() - t0,
            "sync/bytes": float(nbytes),
            "sync/bytes_max_rank": most,
            "sync/bytes_total": total,
            "sync/buckets": float(nbuckets),
            "sync/bucket_s_max": max(bucket_times, default=0.0),
            "sync/version": float(self.version),
            **({"sync/lora_adapter_bytes": float(self.lora_bytes)} if self.lora_bytes else {}),
            **(delta() if delta is not None else {}),
            **({"sync/delta_engines_rebased": float(rebased)} if rebased is not None else {}),
        }

    def _sink(self) -> FlatBucketSink | None:
        """The export stream's sink for one sync (the same on every rank): the bucket buffer (SGLang
        modes) and the topology's routing (owner-direct); None (plain lists) without either."""
        routing = getattr(self.topology, "routing", None)
        if self.bucket_buffer is None and routing is None:
            return None
        return FlatBucketSink(self.bucket_buffer, routing)

    def _forget_restarted_engines(self, transport) -> bool:
        """Collective (delta sync, before ``begin``): whether some engine reports a weight version other
        than the last sync's (``self.version - 1``, called after this sync's increment; module docstring), in which
        case every rank's encoder is reset. An engine that does not answer counts as restarted (the
        sync then fails on it the usual way)."""
        stale, _, _ = _failed_and_bytes(engines_stale(transport, str(self.version - 1)), 0.0)
        if stale:
            self.engines_restarted()
        return stale

    def engines_restarted(self) -> None:
        """After a failed sync or an engine restart (every rank): a delta-sync transport forgets
        what it sent, so the next sync is full (``weight_sync.delta``)."""
        reset = getattr(self.topology.transport, "reset_delta", None)
        if reset is not None:
            reset()


def engines_stale(transport, expected: str) -> bool:
    """Whether an engine this rank's ``transport`` talks to reports a weight version other than
    ``expected`` (the last sync's) or does not answer: it holds no base for a delta."""
    if transport is None:
        return False
    try:
        return any(v != expected for v in transport.engine_versions())
    except Exception:  # noqa: BLE001 - an engine that does not answer holds no known base
        return True


def _lora_of(model):
    """``model.lora`` of the GPTModel inside DDP / Float16Module wrappers (set on every rank by
    ``models.build``), or None."""
    while not hasattr(model, "lora") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "lora", None)


def bucket_nbytes(bucket) -> int:
    """Payload bytes of a bucket of (name, tensor): numel * element size, summed."""
    return sum(t.numel() * t.element_size() for _, t in bucket)


def _gather_to_rank0(obj) -> list:
    if rdist.world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def _failed_and_bytes(failed: bool, value: float) -> tuple[bool, float, float]:
    """(whether any rank failed, the largest ``value``, the sum of ``value``) over all ranks, by
    one all-gather of two numbers per rank."""
    if rdist.world_size() == 1:
        return failed, value, value
    import torch

    from gspo_megatron.runtime.distributed import device

    mine = torch.tensor([1.0 if failed else 0.0, value], dtype=torch.float64, device=device())
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    rows = torch.stack(everyone).cpu()
    return bool(rows[:, 0].max().item() > 0), float(rows[:, 1].max().item()), float(rows[:, 1].sum().item())
