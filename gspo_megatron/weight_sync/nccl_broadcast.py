"""NCCL broadcast transport (disaggregated: SGLang engines on their own GPUs / nodes).

One process group per pipeline stage: its rank 0 is that stage's source rank (the stage's first rank
with DP = TP = EP = CP = 0, which receives its stage's full HF-named tensors from the export stream),
ranks 1.. are every GPU of every engine (engine i's TP ranks start at ``1 + sum(engine_world_sizes[:i])``). SGLang's
``init_weights_update_group`` makes the engines join; the trainer joins with
:func:`init_external_process_group`. Per bucket: each engine is told the metadata
(``update_weights_from_distributed(names, dtypes, shapes, group_name, load_format="flattened_bucket")``),
which blocks while the source broadcasts the bucket's bytes as one uint8 tensor from group rank 0
(:func:`flatten_bucket`; the engines allocate it by the metadata). Without sglang's
``FlattenedTensorBucket.empty``: one broadcast per tensor, received in the same order.

Ranks: only source ranks construct and call this transport (``weight_sync.topology`` builds one per
stage). With several stages sending to the same engines, a ``lock`` (:class:`StoreLock`) makes the
stages take turns per bucket (first come, first served): engines serve requests one at a time,
and two stages interleaving across engines would deadlock. The bytes leaving a source are its stage's share of the model.
gloo on CPU (``backend="gloo"``, the CPU rollout server), NCCL on GPU: the same code.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
import torch.distributed as dist

from gspo_megatron.dtypes import dtype_name
from gspo_megatron.engines.sglang_compat import flattened_bucket_class
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.weight_sync.fp8_quant import quantize_bucket_fp8
from gspo_megatron.weight_sync.transport import StageSourceSessions, WeightTransport

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName


def pp_group_name(pp_rank: int, prefix: str = "gspo_weights") -> str:
    """Name of the weight-update group of pipeline stage ``pp_rank``."""
    return f"{prefix}_pp{pp_rank}"


def engine_rank_offsets(engine_world_sizes: Sequence[int]) -> tuple[list[int], int]:
    """([first group rank of each engine], group world size) with the trainer source at rank 0."""
    if not engine_world_sizes or any(int(s) < 1 for s in engine_world_sizes):
        raise ValueError(f"engine_world_sizes must be positive GPU counts, got {list(engine_world_sizes)}")
    offsets, nxt = [], 1
    for s in engine_world_sizes:
        offsets.append(nxt)
        nxt += int(s)
    return offsets, nxt


def bucket_metadata(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtype strings like "bfloat16", shapes as int lists) in bucket order: what SGLang's
    ``update_weights_from_distributed`` needs to allocate the receive buffers."""
    names, dtypes, shapes = [], [], []
    for name, t in bucket:
        names.append(name)
        dtypes.append(dtype_name(t.dtype))
        shapes.append([int(d) for d in t.shape])
    return names, dtypes, shapes


def flatten_bucket(
    bucket: Sequence[tuple[str, torch.Tensor]], device: torch.device | str
) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """(one uint8 tensor on ``device`` holding the bucket's bytes, the bucket in that byte order):
    the layout sglang's ``FlattenedTensorBucket.empty(names, dtypes, shapes)`` rebuilds (back to
    back, widest elements first so each offset is element-aligned). A ``weight_sync.buckets.FlatBucket``
    already laid out so on ``device`` is used as it is (no copy)."""
    device = torch.device(device)
    flat = getattr(bucket, "flat", None)
    if flat is not None and flat.device == device:
        ordered = sorted(bucket, key=lambda nt: bucket.byte_offset(nt[1]))  # type: ignore[attr-defined]
        pos = 0
        for _, t in ordered:
            if bucket.byte_offset(t) != pos or not t.is_contiguous():  # type: ignore[attr-defined]
                break
            pos += t.numel() * t.element_size()
        else:
            return flat[:pos], ordered
    ordered = sorted(bucket, key=lambda nt: -nt[1].element_size())
    total = sum(t.numel() * t.element_size() for _, t in ordered)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    pos = 0
    for _, t in ordered:
        n = t.numel() * t.element_size()
        flat[pos : pos + n].view(t.dtype).view(t.shape).copy_(t)
        pos += n
    return flat, ordered


def init_external_process_group(
    backend: str,
    init_method: str | None,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta | None = None,
    prefer_sglang: bool = True,
    store: Any = None,
) -> Any:
    """A process group with peers outside this job's default world (the SGLang engines).

    ``init_method``: a ``tcp://host:port`` rendezvous; or None and ``store``, a torch.distributed
    Store this rank already holds (the group's rank 0 starts its TCPStore before the engines are
    told the port).
    Uses sglang's ``init_custom_process_group`` (the same helper the engines use) when sglang is
    installed; otherwise the equivalent torch calls (torch has no public API for a second, disjoint
    world group, hence the private helpers).

    The store's keys: sglang 0.5.23 (``srt/utils/common.py``) wraps the store in
    ``PrefixStore(group_name, ...)`` only when it made the store itself by rendezvous (the engine's
    path: ``weight_updater.init_weights_update_group`` passes ``init_method``); a store passed in is
    used as it is. So a store handed in here is wrapped here, with the same prefix, before either
    helper sees it: both sides then read and write ``<group_name>/...`` and the group forms.
    """
    from torch.distributed.distributed_c10d import PrefixStore, default_pg_timeout

    if store is not None:
        if init_method is not None:
            raise ValueError("init_external_process_group: give init_method or store, not both")
        store.set_timeout(timeout or default_pg_timeout)
        store = PrefixStore(group_name, store)
    with _outside_torchelastic():
        if prefer_sglang:
            try:
                from sglang.srt.utils.common import init_custom_process_group
            except ImportError:
                init_custom_process_group = None
            if init_custom_process_group is not None:
                return init_custom_process_group(
                    backend=backend,
                    init_method=init_method,
                    store=store,
                    world_size=world_size,
                    rank=rank,
                    group_name=group_name,
                    timeout=timeout,
                )
        return _torch_external_group(backend, init_method, store, world_size, rank, group_name, timeout)


@contextmanager
def _outside_torchelastic():
    """Under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``) torch's ``tcp://`` rendezvous never
    starts a store server, it connects to the agent's: a group with outside peers would hang. The
    trainer rank is this group's rank 0 and must serve the store itself."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved


def _torch_external_group(
    backend: str,
    init_method: str | None,
    store: Any,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta | None,
) -> Any:
    from torch.distributed.distributed_c10d import (
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
        rendezvous,
    )

    timeout = timeout or default_pg_timeout
    if store is None:  # as sglang's helper: only the store made here by rendezvous is prefixed here
        if init_method is None:  # what torch's rendezvous says to a missing url
            raise RuntimeError(f"`url` must be a string. {type(init_method)}: {init_method}")
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=cast("GroupName", group_name), timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class StoreLock:
    """A FIFO mutex over a torch.distributed Store (e.g. the default TCPStore) shared by all source
    ranks: a ticket lock. ``add`` hands out tickets atomically; the holder of ticket t waits (the
    store's blocking ``wait``, no polling) for the key that the holder of t - 1 sets on release, and
    deletes it once it holds the lock (the store keeps no key per acquisition). While held, ``key``
    names the holder's ``token`` ("" when free)."""

    def __init__(self, store: Any, key: str = "gspo_weight_sync_lock", poll_s: float = 0.05):
        self.store, self.key = store, key
        self.poll_s = poll_s  # unused since the ticket lock (kept for callers passing it)
        self.token = f"held-by-{rdist.rank()}-{id(self)}"
        self.ticket = 0

    def __enter__(self) -> "StoreLock":
        self.ticket = int(self.store.add(f"{self.key}/tickets", 1))
        if self.ticket > 1:
            turn = f"{self.key}/turn/{self.ticket}"
            self.store.wait([turn])
            self.store.delete_key(turn)
        self.store.set(self.key, self.token)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.store.set(self.key, "")
        self.store.set(f"{self.key}/turn/{self.ticket + 1}", "1")


class NcclBroadcastTransport(StageSourceSessions, WeightTransport):
    """Disaggregated transport for one pipeline stage's source rank (see module docstring).

    clients: one client per engine (``engines.sglang_client``). engine_world_sizes: GPUs per engine
    (tp * pp * ... of that engine). master_address/master_port: where the group's TCP store listens
    (this host; port 0: the OS picks a free one at each connect, see :meth:`connect`). device: where
    tensors are broadcast from (cuda for nccl).
    manage_session: pause/flush/open the engines' update session in begin (set on one stage only;
    ``barrier`` then lets the other stages wait for it, and is called again before closing).
    prefer_sglang_group_helper: join with sglang's own group helper when importable (else torch's).
    flattened: send each bucket as one broadcast of its bytes (``load_format="flattened_bucket"``,
    :func:`flatten_bucket`) where sglang has it, instead of one broadcast per tensor (off by
    default for engines without that route; ``weight_sync.topology`` turns it on).
    """

    def __init__(
        self,
        clients: Sequence[Any],
        *,
        engine_world_sizes: Sequence[int],
        master_address: str,
        master_port: int,
        group_name: str = pp_group_name(0),
        backend: str = "nccl",
        device: torch.device | str | None = None,
        fp8: bool = False,
        lock: Any = None,
        manage_session: bool = True,
        barrier: Callable[[], None] | None = None,
        timeout_s: float = 1800.0,
        prefer_sglang_group_helper: bool = True,
        flattened: bool = False,
    ):
        if len(clients) != len(engine_world_sizes):
            raise ValueError(
                f"NcclBroadcastTransport: {len(clients)} clients but {len(engine_world_sizes)} engine_world_sizes"
            )
        self.clients = list(clients)
        self.rank_offsets, self.world_size = engine_rank_offsets(engine_world_sizes)
        self.master_address, self.master_port = master_address, int(master_port)
        self.group_name, self.backend = group_name, backend
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.device = torch.device(device)
        self.fp8, self.lock, self.manage_session, self.barrier = fp8, lock, manage_session, barrier
        self.timeout = timedelta(seconds=timeout_s)
        self.prefer_sglang = prefer_sglang_group_helper
        self.group: Any = None
        self.failed: BaseException | None = None
        self.weight_version = "0"
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.clients)))
        # sglang 0.5.23's update_weights_from_distributed(load_format="flattened_bucket") receives
        # a bucket as one broadcast (FlattenedTensorBucket.empty: names in byte order, no gaps)
        self.flattened = flattened and hasattr(flattened_bucket_class(), "empty")

    # -- group lifecycle -------------------------------------------------------------------------
    def connect(self) -> None:
        """Create the group: this rank (the group's rank 0) first starts the group's TCP store
        listening (on ``master_port``; 0: a port the OS picks as it binds, so no other process can
        take it between choosing and binding), then the engines join (blocking calls, run in
        threads) while this rank joins. Idempotent; after an engine restart use :meth:`reconnect` (a
        restarted engine is no longer in the group)."""
        if self.group is not None:
            return
        # the group keeps the store (and its server) alive until it is destroyed
        store = dist.TCPStore(
            self.master_address, self.master_port, self.world_size, True, self.timeout, wait_for_workers=False
        )
        futures = [
            self._pool.submit(
                c.init_weights_update_group,
                self.master_address,
                store.port,
                off,
                self.world_size,
                self.group_name,
                self.backend,
            )
            for c, off in zip(self.clients, self.rank_offsets)
        ]
        self.group = init_external_process_group(
            self.backend,
            None,
            self.world_size,
            0,
            self.group_name,
            self.timeout,
            prefer_sglang=self.prefer_sglang,
            store=store,
        )
        for f in futures:
            f.result()

    def close(self, tolerate_errors: bool = False) -> None:
        """Destroy the group on the engines and here. ``tolerate_errors``: an engine that died (and
        was restarted without the group) may refuse or fail the call; go on."""
        if self.group is None:
            return
        futures = [self._pool.submit(c.destroy_weights_update_group, self.group_name) for c in self.clients]
        try:
            dist.destroy_process_group(self.group)
        except Exception:  # a broken group (dead peer) cannot always be torn down cleanly
            if not tolerate_errors:
                raise
        self.group = None
        for f in futures:
            try:
                f.result()
            except Exception:
                if not tolerate_errors:
                    raise

    def reconnect(self) -> None:
        """After engines were restarted: every engine leaves the old group and all join a new one
        (same name; with ``master_port`` 0 the store gets a fresh port)."""
        self.close(tolerate_errors=True)
        self.connect()

    # -- one sync --------------------------------------------------------------------------------
    # Stage sources meet in ``barrier`` in begin / end: whatever the engines do, every source gets
    # there (``StageSourceSessions``).
    def begin(self, version: str) -> None:
        self.failed = None
        self._guarded(self.connect)
        self.weight_version = version
        self._open_sessions()

    def send_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.fp8:
            bucket = quantize_bucket_fp8(bucket)
        if not bucket or self.failed is not None:
            return
        load_format = None
        if self.flattened:  # one broadcast of the bucket's bytes (sglang's ``flattened_bucket``)
            flat, bucket = flatten_bucket(bucket, self.device)
            tensors = [flat]
            load_format = "flattened_bucket"
        else:
            tensors = [t.detach().to(self.device).contiguous() for _, t in bucket]
        names, dtypes, shapes = bucket_metadata(bucket)
        if self.lock is not None:
            with self.lock:
                self._guarded(self._broadcast, names, dtypes, shapes, tensors, load_format)
        else:
            self._guarded(self._broadcast, names, dtypes, shapes, tensors, load_format)

    def _broadcast(self, names, dtypes, shapes, tensors, load_format=None) -> None:
        kw = {"load_format": load_format} if load_format is not None else {}
        futures = [
            self._pool.submit(
                c.update_weights_from_distributed,
                names,
                dtypes,
                shapes,
                self.group_name,
                False,
                self.weight_version,
                **kw,
            )
            for c in self.clients
        ]
        handles = [dist.broadcast(t, 0, group=self.group, async_op=True) for t in tensors]
        for h in handles:
            h.wait()
        for f in futures:
            f.result()  # raises SGLangError naming the engine if it failed to load

    def end(self) -> None:
        self._close_sessions()
