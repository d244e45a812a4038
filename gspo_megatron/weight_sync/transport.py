"""The transport interface: how one bucket of full HF-named tensors reaches the rollout engines.

The engine-independent plan (``weight_sync.plan``) gathers TP/EP/PP shards, renames to HF and cuts
buckets on every training rank; the transport is then called on the rank(s) that own the engine
connection. One class per mode (slime style): in-process (CPU engine), CUDA IPC (colocated SGLang),
NCCL broadcast (disaggregated SGLang).
"""

from __future__ import annotations

import abc
from typing import Sequence

import torch


class WeightTransport(abc.ABC):
    """Sends buckets to engines. ``begin`` / ``end`` bracket one full sync."""

    def begin(self) -> None:
        """Called once before the first bucket of a sync (pause engines, open groups)."""

    @abc.abstractmethod
    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Deliver one bucket: a list of (hf_name, full tensor)."""

    def end(self) -> None:
        """Called once after the last bucket (flush caches, resume engines)."""


class InProcessTransport(WeightTransport):
    """CPU / tests: hand buckets straight to an engine object living in this process."""

    def __init__(self, engine):
        self.engine = engine

    def begin(self) -> None:
        self.engine.begin_weight_update()

    def send_bucket(self, bucket):
        self.engine.update_weights(bucket)

    def end(self) -> None:
        self.engine.end_weight_update()
