"""Per-bucket timing and byte counts of one weight sync, as a metrics dict the trainer merges.

Used by the GPU transports (CUDA IPC, NCCL broadcast) on the ranks that send. Wall-clock only:
callers make the timed region synchronous (the engine call returns, or the broadcast is waited on).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch


def bucket_nbytes(bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
    """Total payload bytes of a bucket (numel * element size, summed)."""
    return sum(t.numel() * t.element_size() for _, t in bucket)


class SyncStats:
    """Accumulates bucket durations and bytes for one sync (``start`` ... ``metrics``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.bucket_seconds: list[float] = []
        self.total_bytes = 0
        self._t0: float | None = None
        self._total: float | None = None

    def start(self) -> None:
        """Begin a sync: clears the previous one's numbers."""
        self.reset()
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._t0 is not None:
            self._total = time.perf_counter() - self._t0

    @contextmanager
    def bucket(self, nbytes: int) -> Iterator[None]:
        """Time one bucket; ``nbytes`` is added to the byte count when the block succeeds."""
        t0 = time.perf_counter()
        yield
        self.bucket_seconds.append(time.perf_counter() - t0)
        self.total_bytes += int(nbytes)

    def metrics(self, prefix: str = "sync/") -> dict[str, float]:
        """``{prefix}bucket_s_mean, bucket_s_max, total_s, bytes, buckets}``; empty before any bucket."""
        if not self.bucket_seconds:
            return {}
        total = self._total
        if total is None:
            total = time.perf_counter() - self._t0 if self._t0 is not None else sum(self.bucket_seconds)
        n = len(self.bucket_seconds)
        return {
            f"{prefix}bucket_s_mean": sum(self.bucket_seconds) / n,
            f"{prefix}bucket_s_max": max(self.bucket_seconds),
            f"{prefix}total_s": float(total),
            f"{prefix}bytes": float(self.total_bytes),
            f"{prefix}buckets": float(n),
        }
