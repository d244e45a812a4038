"""The transport interface: how one bucket of full HF-named tensors reaches the rollout engines.

The export stream (``models.weights.export_hf_weights``) gathers TP/EP/PP shards, renames to HF and
cuts buckets; ``weight_sync.topology`` routes each bucket to the ranks that send it and builds the
transport of each such rank. One class per mode (slime style): in-process (CPU transformers engine
on rank 0), CUDA IPC (colocated SGLang: every training rank feeds the engine TP rank on its GPU),
NCCL broadcast (disaggregated SGLang: each pipeline stage's source broadcasts its own part), delta
through a shared directory (disaggregated SGLang with ``rollout.sync_delta``: the changes in files, named
to the engines by HTTP; ``weight_sync.delta_http``).
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Sequence

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


class StageSourceSessions:
    """What the transports with one source rank per pipeline stage, each sending to every engine
    (``NcclBroadcastTransport``, ``DeltaHttpTransport``), share: an engine call that fails is
    remembered and the later ones are skipped (``_guarded``; ``end`` raises it after the barrier, and
    ``keeps_step`` tells the syncer to keep calling so the sources stay in step); the stage that
    ``manage_session`` opens and closes the engines' weight-update session (pause, flush, version) and
    every source meets the others in ``barrier`` after opening and before closing."""

    keeps_step = True
    clients: list
    manage_session: bool
    barrier: Callable[[], None] | None
    failed: BaseException | None

    def _guarded(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        if self.failed is None:
            try:
                fn(*args, **kw)
            except Exception as e:  # noqa: BLE001 - raised by end()
                self.failed = e

    def _open_sessions(self) -> None:
        from gspo_megatron.engines.sglang_client import open_weight_update

        if self.manage_session:
            for c in self.clients:
                self._guarded(open_weight_update, c)
        if self.barrier is not None:
            self.barrier()

    def _close_sessions(self) -> None:
        """After the barrier: close the sessions, then raise the first failure of this sync."""
        from gspo_megatron.engines.sglang_client import close_weight_update

        if self.barrier is not None:
            self.barrier()
        if self.manage_session:
            for c in self.clients:
                self._guarded(close_weight_update, c)
        if self.failed is not None:
            raise self.failed


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
