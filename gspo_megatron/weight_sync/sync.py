"""Push the trainer's current weights to the rollout engine(s) after an optimizer step.

Every rank calls ``sync_weights``: the export stream (``models.weights.export_hf_weights``) gathers
TP / EP / PP shards and renames them to the HF layout on every rank; global rank 0 holds the
transport and sends each bucket. The same stream writes HF checkpoints, so what the engine gets is
exactly what an export would contain.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gspo_megatron.models.weights import build_export_plan, export_hf_weights


class WeightSyncer:
    """Caches the export plan (one all_gather_object) and times each sync."""

    def __init__(self, model, bucket_mb: float = 512.0, verify: bool = False):
        self.model = model
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        self.verify = verify
        self.plan = build_export_plan(model)

    def sync(self, transport=None, engine=None) -> dict:
        """Collective. ``transport`` (and ``engine``, for verification) only on global rank 0."""
        t0 = time.perf_counter()
        rank = dist.get_rank() if dist.is_initialized() else 0
        checksums: dict[str, float] = {}
        nbytes, nbuckets, bucket_times = 0, 0, []
        # A transport failure (dead engine) must not leave the other ranks stuck in the export
        # collectives: rank 0 keeps iterating the stream without sending and reports the error.
        self.error: BaseException | None = None
        if rank == 0 and transport is not None:
            self._guard(transport.begin)
        for bucket in export_hf_weights(self.model, self.bucket_bytes, plan=self.plan):
            if bucket is None or rank != 0 or transport is None or self.error is not None:
                continue
            tb = time.perf_counter()
            self._guard(transport.send_bucket, bucket)
            bucket_times.append(time.perf_counter() - tb)
            nbuckets += 1
            for name, t in bucket:
                nbytes += t.numel() * t.element_size()
                if self.verify:
                    checksums[name] = float(t.detach().to(torch.float64).sum())
        if rank == 0 and transport is not None and self.error is None:
            self._guard(transport.end)
        metrics = {"sync/total_s": time.perf_counter() - t0, "sync/bytes": float(nbytes),
                   "sync/buckets": float(nbuckets),
                   "sync/bucket_s_max": max(bucket_times, default=0.0)}
        if self.error is not None:
            return metrics
        if rank == 0 and self.verify and engine is not None:
            got = engine.weight_checksums(list(checksums))
            bad = [n for n, v in checksums.items() if got.get(n) != v]
            if bad:
                raise RuntimeError(f"weight sync verification failed for {len(bad)} tensors, e.g. {bad[0]}: "
                                   f"trainer {checksums[bad[0]]!r} vs engine {got.get(bad[0])!r}")
            metrics["sync/verified_tensors"] = float(len(checksums))
        return metrics

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - reported to the caller through self.error
            self.error = e
