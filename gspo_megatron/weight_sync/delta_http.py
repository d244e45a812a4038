"""Delta sync to engines on other hosts (``rollout.sync_mode=disaggregated`` or ``rollout.engine_urls``
with ``rollout.sync_delta=true``): each bucket's encoded changes (and the tensors that go whole) in a
file on a shared file system, named to the engines' delta loader by HTTP.

Why not the NCCL broadcast of full syncs: sglang 0.5.23 applies a custom weight loader only on
``update_weights_from_tensor`` (``model_runner_components/weight_updater.py``); its
``update_weights_from_distributed`` path always calls ``model.load_weights``, so the engine's delta
loader (``weight_sync.delta_loader``) could neither apply a delta nor keep the copy later deltas build
on. ``update_weights_from_tensor`` carries one serialized payload per engine TP rank in the HTTP body;
sglang's ``MultiprocessingSerializer`` would pass CPU tensors as shared-memory files of the sender's
host (and CUDA tensors as IPC handles), neither of which opens on another host. So the payload is
pickled by value (``pickle`` writes each tensor's storage bytes; sglang's ``SafeUnpickler`` reads them
with ``torch.load(weights_only=True)``: ``srt/utils/common.py`` maps ``torch.storage._load_from_bytes`` to
``_safe_load_torch_storage``) and base64-encoded, as the route expects; and it holds only the epoch and
a ``FILE`` entry (``weight_sync.delta``), because the body repeats it for every engine TP rank: the
changes themselves are written once, as one safetensors file per bucket under
``rollout.sync_delta_dir`` (``<output_dir>/sync_delta`` by default; it must be visible to the engine
hosts at the same path), and every engine TP rank reads them from there.

Per bucket, on one source rank per pipeline stage (the ranks the NCCL transport would send from):
``DeltaEncoder.encode_bucket``; the whole wire list (index / bitmask / value records, and the tensors
that go whole: every one in the first sync and after an engine restart or failed sync, any whose delta
would not be smaller) to the file; the payload to every engine. The files of a sync are removed when it
ends: the engines keep their own copy.

Bytes: per sync the source writes its stage's encoded changes once and every engine TP rank reads all
stages' (a full sync: the whole model, written once, read by every engine TP rank), instead of the
NCCL ring carrying the whole model. Sessions (pause, flush, version) as the NCCL transport: stage 0
opens and closes them, the stage sources meet in ``barrier`` in begin / end.
"""

from __future__ import annotations

import base64
import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from gspo_megatron.weight_sync.delta import DeltaEncoder, file_entry
from gspo_megatron.weight_sync.delta_loader import LOADER_NAME
from gspo_megatron.weight_sync.fp8_quant import quantize_bucket_fp8
from gspo_megatron.weight_sync.transport import StageSourceSessions, WeightTransport


def serialize_by_value(entries: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``[(name, tensor)]`` -> base64 text that sglang's ``MultiprocessingSerializer.deserialize`` reads
    on any host (tensors pickled with their bytes, on the CPU)."""
    plain = [(n, t.detach().to("cpu").contiguous()) for n, t in entries]
    return base64.b64encode(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


class DeltaHttpTransport(StageSourceSessions, WeightTransport):
    """One pipeline stage's source rank (see module docstring). ``clients``: one per engine;
    ``engine_world_sizes``: TP ranks per engine (one payload each); ``full_dir``: where full tensors are
    written (shared with the engine hosts); ``stage``: names the files; ``manage_session``: this stage
    opens / closes the engines' update session; ``barrier``: the stage sources' barrier (or None);
    ``fp8``: quantize the big projections blockwise first (``fp8_quant``, ``rollout.sync_fp8``): the
    copy, the changes and the engine's rebuilt tensors are then the FP8 codes and block scales a full
    FP8 sync sends."""

    delta = True

    def __init__(
        self,
        clients: Sequence[Any],
        *,
        engine_world_sizes: Sequence[int],
        full_dir: str,
        stage: int = 0,
        manage_session: bool = True,
        barrier: Callable[[], None] | None = None,
        fp8: bool = False,
    ):
        if len(clients) != len(engine_world_sizes):
            raise ValueError(f"DeltaHttpTransport: {len(clients)} clients but {len(engine_world_sizes)} world sizes")
        self.clients, self.world_sizes = list(clients), [int(s) for s in engine_world_sizes]
        self.full_dir, self.stage = full_dir, int(stage)
        self.manage_session, self.barrier = manage_session, barrier
        self.fp8 = fp8
        self.encoder = DeltaEncoder()
        self.failed: BaseException | None = None
        self.weight_version = "0"
        self._files: list[str] = []
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))

    def begin(self, version: str) -> None:
        self.failed, self.weight_version, self._files = None, version, []
        self.encoder.begin()
        self._open_sessions()

    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        if not bucket:
            return
        if self.fp8:
            bucket = quantize_bucket_fp8(bucket)
        entries = self.encoder.encode_bucket(bucket)  # the copy is updated even if the engines fail
        if self.failed is not None:
            return
        wire = [entries[0]]
        if len(entries) > 1:
            wire.append(file_entry(self._write(entries[1:])))
        self._guarded(self._post, serialize_by_value(wire))

    def _write(self, entries: list[tuple[str, torch.Tensor]]) -> str:
        """The bucket's wire entries (full tensors and changes) as one safetensors file; its path."""
        from safetensors.torch import save_file

        folder = os.path.join(self.full_dir, f"epoch-{self.encoder.epoch}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"stage{self.stage}-v{self.weight_version}-{len(self._files)}.safetensors")
        save_file({n: t.detach().to("cpu").contiguous() for n, t in entries}, path)
        self._files.append(path)
        return path

    def _post(self, payload: str) -> None:
        futures = [
            self._pool.submit(
                c.update_weights_from_tensor,
                [payload] * size,
                load_format=LOADER_NAME,
                flush_cache=False,
                weight_version=self.weight_version,
            )
            for c, size in zip(self.clients, self.world_sizes)
        ]
        for f in futures:
            f.result()  # raises SGLangError naming the engine

    def end(self) -> None:
        try:
            self._close_sessions()
        finally:  # every engine has loaded them (or the sync failed: the next is full)
            for path in self._files:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
            self._files = []

    def delta_metrics(self) -> dict[str, float]:
        return self.encoder.stats.metrics()

    def reset_delta(self) -> None:
        """The engines may hold anything (a failed sync, a restart): the next sync is full."""
        self.encoder.reset()

    def engine_versions(self) -> list[str | None]:
        """The weight version each engine reports (``WeightSyncer``'s check before a delta sync)."""
        return [c.weight_version() for c in self.clients]

    def connect(self) -> None:
        """No group to form (HTTP and files)."""

    def reconnect(self) -> None:
        """After an engine restart: nothing to rebuild; the syncer's ``engines_restarted`` resets the copy."""

    def close(self, tolerate_errors: bool = False) -> None:
        self._pool.shutdown(wait=False)
