"""CUDA IPC transport (colocated: training ranks and SGLang engines share GPUs).

Layout (as slime does it): an engine with TP size k runs on the GPUs of k consecutive training
ranks ``[src, src + k)``. Every one of those ranks holds the same full bucket on its own GPU; each
flattens it (sglang's ``FlattenedTensorBucket``: all tensors viewed as uint8 and concatenated, plus
name/shape/dtype/offset metadata; a ``weight_sync.buckets.FlatBucket`` from the sync's export stream is
already one reused buffer and is described, not copied) and serializes the CUDA IPC handle with sglang's
``MultiprocessingSerializer`` (base64 string). A gloo ``gather_object`` brings the k payloads to
``src``, which calls ``update_weights_from_tensor(serialized_named_tensors=[payload of rank 0..k-1],
load_format="flattened_bucket")``; engine TP rank i opens payload i, i.e. memory on its own GPU.
A barrier after the call keeps every producer's buffer alive until the engine has read it.
On CPU (the CPU rollout server) the same code runs with CPU tensors, which the serializer passes as
named shared-memory segments (``sglang_compat.use_cpu_shared_memory``) instead of CUDA IPC handles.

Ranks: every training rank colocated with an engine calls begin / send_bucket / end (they are
collective over ``gather_group``); only ``src`` talks to the engine, and it also pauses the engine,
flushes its cache and opens/closes SGLang's weight-update session in begin / end.

Delta sync (``rollout.sync_delta``, ``weight_sync.delta``): ``src`` keeps the host copy of what it
last sent and encodes each bucket (changed elements only); the encoded entries that are not a full
tensor go to the other ranks of the group by one ``broadcast_object_list`` (small: the changed
elements), the full ones each rank takes from its own bucket. Each rank serializes the plain entry
list for its engine TP rank and the engine is called with ``load_format`` = the delta loader's
dotted name (sglang's ``--custom-weight-loader`` route; no flattening: that route takes a list).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from gspo_megatron.engines.sglang_client import close_weight_update, open_weight_update
from gspo_megatron.engines.sglang_compat import (
    flattened_bucket_class,
    flattened_metadata_class,
    multiprocessing_serializer,
    patch_torch_reductions,
)
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.weight_sync.delta import PREFIX as DELTA_PREFIX
from gspo_megatron.weight_sync.delta import DeltaEncoder
from gspo_megatron.weight_sync.fp8_quant import quantize_bucket_fp8
from gspo_megatron.weight_sync.transport import WeightTransport


def group_for_flattening(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """One group when FlattenedTensorBucket mixes dtypes (``supports_multi_dtypes``), else one group
    per dtype in first-seen order (older sglang flattened a single dtype)."""
    if not bucket:
        return []
    cls = flattened_bucket_class()
    if cls is not None and getattr(cls, "supports_multi_dtypes", False):
        # FlattenedTensorBucket packs byte ranges back to back and its receiver views each range as
        # the tensor's dtype, which needs offset % element_size == 0: widest elements first
        # guarantees that (e.g. a bf16 tensor of odd numel before an fp32 one would not).
        return [sorted(bucket, key=lambda nt: -nt[1].element_size())]
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, t in bucket:
        groups.setdefault(t.dtype, []).append((name, t))
    return list(groups.values())


def view_metadata(name: str, t: torch.Tensor, flat: torch.Tensor) -> Any:
    """sglang's ``FlattenedTensorMetadata`` of ``t``, a view into the uint8 buffer ``flat`` (a
    ``weight_sync.buckets.FlatBucket``'s tensor): the buffer is described, not copied."""
    cls = flattened_metadata_class()
    if cls is None:
        raise ImportError("describing a flat bucket needs sglang's FlattenedTensorMetadata")
    start, nbytes = t.data_ptr() - flat.data_ptr(), t.numel() * t.element_size()
    return cls(name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + nbytes, numel=nbytes)


def serialize_bucket(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """bucket -> payload strings for ``update_weights_from_tensor`` (one per flatten group).

    With FlattenedTensorBucket: ``{"flattened_tensor": uint8 [bytes], "metadata": [...]}`` per
    group (load_format "flattened_bucket"); without: the plain ``[(name, tensor), ...]`` list
    (load_format None). Tensors are made contiguous; the returned strings reference their memory,
    so the caller keeps the bucket alive until the engine has loaded it.
    """
    ser = multiprocessing_serializer()
    patch_torch_reductions([t for _, t in bucket])
    cls = flattened_bucket_class()
    flat = getattr(bucket, "flat", None)  # weight_sync.buckets.FlatBucket: already one buffer
    meta_cls = flattened_metadata_class()
    if flat is not None and bucket and meta_cls is not None and getattr(cls, "supports_multi_dtypes", False):
        metadata = [view_metadata(name, t, flat) for name, t in bucket]
        return [ser.serialize({"flattened_tensor": flat, "metadata": metadata}, output_str=True)]
    bucket = [(n, t.detach().contiguous()) for n, t in bucket]
    if cls is None:
        return [ser.serialize(list(bucket), output_str=True)] if bucket else []
    payloads = []
    for group in group_for_flattening(bucket):
        flat = cls(named_tensors=group)
        payloads.append(
            ser.serialize(
                {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}, output_str=True
            )
        )
    return payloads


def deserialize_payload(payload: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of one :func:`serialize_bucket` payload (what an engine TP rank does on receipt)."""
    obj = multiprocessing_serializer().deserialize(payload)
    if isinstance(obj, dict):
        cls = flattened_bucket_class()
        if cls is None:  # a dict payload is a flattened bucket: serialize_bucket had the class
            raise ImportError(
                "a flattened_bucket payload needs sglang's FlattenedTensorBucket, which does not import here"
            )
        return cls(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]).reconstruct_tensors()
    return list(obj)


class CudaIpcTransport(WeightTransport):
    """Colocated CUDA-IPC transport; see the module docstring for the rank layout.

    client: the engine client (``engines.sglang_client``); required on ``gather_src`` only.
    gather_group: gloo group of the k training ranks on this engine's GPUs (None when k == 1).
    gather_src: global rank of the group member that owns ``client`` (the group's first rank).
    fp8: quantize the big projections blockwise (``fp8_quant``) before sending.
    manage_session: on ``gather_src``, pause + flush + begin session in ``begin`` and the reverse
    in ``end`` (turn off when the trainer brackets the sync itself).
    delta: send changed elements only (module docstring); the engines must run the delta loader.
    """

    def __init__(
        self,
        client: Any = None,
        *,
        gather_group: Any = None,
        gather_src: int | None = None,
        fp8: bool = False,
        manage_session: bool = True,
        delta: bool = False,
    ):
        self.group = gather_group
        self.src = gather_src if gather_src is not None else (rdist.rank())
        self.rank = rdist.rank()
        self.is_src = self.rank == self.src
        if self.is_src and client is None:
            raise ValueError(f"CudaIpcTransport: rank {self.rank} is gather_src but client is None")
        self.client = client
        self.group_size = dist.get_world_size(gather_group) if gather_group is not None else 1
        if self.is_src and hasattr(client, "tp_size") and int(client.tp_size) != self.group_size:
            raise ValueError(
                f"CudaIpcTransport: engine {client} has tp_size {client.tp_size} but "
                f"gather_group has {self.group_size} ranks (one producer per engine TP rank)"
            )
        self.fp8 = fp8
        self.manage_session = manage_session
        self.load_format = "flattened_bucket" if flattened_bucket_class() is not None else None
        self.delta = delta
        self.encoder = DeltaEncoder() if delta and self.is_src else None
        if delta:
            from gspo_megatron.weight_sync.delta_loader import LOADER_NAME

            self.load_format = LOADER_NAME
        self.failed: BaseException | None = None
        self.weight_version = "0"

    # The k ranks of an engine stay in step (gather + barrier per bucket) whatever the engine does:
    # an engine call that fails is remembered, later calls to that engine are skipped, and ``end``
    # raises it on ``gather_src`` once every bucket has passed. So a dead engine never leaves the
    # other ranks of its group waiting in a collective (``keeps_step`` tells the syncer to go on
    # calling ``send_bucket`` after a failure).
    keeps_step = True

    def _engine_call(self, fn, *args, **kw) -> None:
        if self.failed is None:
            try:
                fn(*args, **kw)
            except Exception as e:  # noqa: BLE001 - raised by end()
                self.failed = e

    def _update(self, payloads: list[str]) -> None:
        """``src``: one ``update_weights_from_tensor`` call, payload i for engine TP rank i."""
        self._engine_call(
            self.client.update_weights_from_tensor,
            payloads,
            load_format=self.load_format,
            flush_cache=False,
            weight_version=self.weight_version,
        )

    def begin(self, version: str) -> None:
        self.weight_version = version
        self.failed = None
        if self.encoder is not None:
            self.encoder.begin()
        if self.is_src and self.manage_session:
            self._engine_call(open_weight_update, self.client)

    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.fp8:
            bucket = quantize_bucket_fp8(bucket)
        payloads = self._delta_payloads(bucket) if self.delta else serialize_bucket(bucket)
        gathered: list[list[str]] | None
        if self.group is not None:
            # each member's payloads, filled in on src
            gathered = [[] for _ in range(self.group_size)] if self.is_src else None
            dist.gather_object(payloads, gathered, dst=self.src, group=self.group)
        else:
            gathered = [payloads]
        if self.is_src:
            if gathered is None:  # src is the gather destination
                raise RuntimeError(f"CudaIpcTransport: rank {self.rank} is gather_src but gathered nothing")
            counts = {len(p) for p in gathered}
            if len(counts) != 1:
                raise RuntimeError(
                    f"CudaIpcTransport: ranks produced different payload counts {counts}: "
                    "every colocated rank must send the same bucket"
                )
            for i in range(len(payloads)):
                self._update([p[i] for p in gathered])
        if self.group is not None:
            dist.barrier(group=self.group)  # producers keep their buffers until the engine loaded
        del payloads, bucket
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()

    def _delta_payloads(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        """The delta entries of ``bucket`` (encoded on ``src``, shared with the group) as one plain
        serialized list for this rank's engine TP rank."""
        plan: list[tuple[str, torch.Tensor | None]] | None = None
        if self.encoder is not None:  # src (a delta transport's encoder lives there)
            # full tensors (plain HF names) every rank has in its own bucket: only the deltas travel
            plan = [(n, t if n.startswith(DELTA_PREFIX) else None) for n, t in self.encoder.encode_bucket(bucket)]
        if self.group is not None:
            box = [plan]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            plan = box[0]
        if plan is None:  # encoded on src, broadcast to the rest of its group
            raise RuntimeError(f"CudaIpcTransport: rank {self.rank} got no delta plan from gather_src {self.src}")
        local = dict(bucket)
        device = bucket[0][1].device if bucket else torch.device("cpu")
        entries = [(n, (local[n] if t is None else t.to(device)).detach().contiguous()) for n, t in plan]
        patch_torch_reductions([t for _, t in entries])
        return [multiprocessing_serializer().serialize(entries, output_str=True)]

    def delta_metrics(self) -> dict[str, float]:
        """This rank's delta-sync totals of the last sync (``src`` only; empty elsewhere)."""
        return self.encoder.stats.metrics() if self.encoder is not None else {}

    def reset_delta(self) -> None:
        """The engines may hold anything (a failed sync, a restart): the next sync is full."""
        if self.encoder is not None:
            self.encoder.reset()

    def engine_versions(self) -> list[str | None]:
        """The weight version the engine reports (``src`` only: the rank that talks to it; else none)."""
        return [self.client.weight_version()] if self.is_src and self.client is not None else []

    def end(self) -> None:
        if self.is_src and self.manage_session:
            self._engine_call(close_weight_update, self.client)
        if self.failed is not None:
            raise self.failed
