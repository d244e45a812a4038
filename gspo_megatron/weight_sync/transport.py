"""The transport interface: how one bucket of full HF-named tensors reaches the rollout engines.

The export stream (``models.weights.export_hf_weights``) gathers TP/EP/PP shards, renames to HF and
cuts buckets; ``weight_sync.topology`` routes each bucket to the ranks that send it and builds the
transport of each such rank. One class per mode (slime style): in-process (CPU transformers engine
on rank 0), CUDA IPC (colocated SGLang: every training rank feeds the engine TP rank on its GPU),
NCCL broadcast (disaggregated SGLang: each pipeline stage's source broadcasts its own part).
"""

from __future__ import annotations

import abc
from typing import Sequence

import torch


class WeightTransport(abc.ABC):
    """Sends buckets to engines. ``begin`` / ``end`` bracket one full sync."""

    def begin(self, version: str) -> None:
        """Called once before the first bucket of a sync (pause engines, open groups); ``version``
        is the weight version the engines report after this sync."""

    @abc.abstractmethod
    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Deliver one bucket: a list of (hf_name, full tensor)."""

    def end(self) -> None:
        """Called once after the last bucket (flush caches, resume engines)."""

    def reconnect(self) -> None:
        """After engines were restarted: rebuild whatever the transport holds on them (groups)."""


class InProcessTransport(WeightTransport):
    """CPU / tests: hand buckets straight to an engine object living in this process."""

    def __init__(self, engine):
        self.engine = engine

    def begin(self, version: str) -> None:
        self.engine.begin_weight_update()

    def send_bucket(self, bucket):
        self.engine.update_weights(bucket)

    def end(self) -> None:
        self.engine.end_weight_update()
