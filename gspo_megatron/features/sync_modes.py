"""The weight-sync modes (``rollout.sync_mode``), one :class:`SyncMode` spec each, registered here.

Plain data with no heavy import, so that the config (``config/loader.py``, ``config/validation.py``),
the planner, the engine fleet, the topology builder and the trainer all ask the spec instead of
comparing mode names:

- ``engine``: the ``rollout.engine`` it serves ("hf": in-process transformers engine; "sglang").
- ``placement``: where the engines run.
  "in_process": inside global rank 0's process (its full model copy is on rank 0's device);
  "colocated": SGLang engines on the training GPUs, engine e on training ranks [e*engine_tp, (e+1)*engine_tp):
  they release their memory while the trainer trains and resume for rollout; ``num_engines`` 0 means
  world / engine_tp, and engine_tp must divide the training world;
  "separate": engines on their own GPUs (launched: rollout.num_engines x engine_tp GPUs outside the
  training world) or already running (rollout.engine_urls).
- ``allows_staleness``: ``rollout.max_staleness >= 1`` is possible (the engines generate the next
  batches while the trainer trains).
- ``attaches``: ``rollout.engine_urls`` (already running engines) may be used.
- ``delta``: ``rollout.sync_delta`` is possible (changed elements only, applied by the engines' custom
  weight loader through ``update_weights_from_tensor``; ``weight_sync/delta.py``; disaggregated engines
  read the changes from a shared directory, ``weight_sync/delta_http.py``).
- ``flat_buckets``: the mode's transport takes the export's buckets as views into one reused buffer
  (``weight_sync.buckets.FlatBucket``) and sends it as it is: no flattening copy, one send per bucket
  (``weight_sync/sync.py``; shared memory on CPU when the engines share the host, ``colocated``).
- ``topology``: ``"module:function"`` building this rank's ``weight_sync.topology.SyncTopology`` (and
  its transport), called as ``function(cfg, rank, engine=..., fleet=...)``; imported when called.

Adding a mode: one :func:`register_sync_mode` call below and its topology builder. :data:`PLACEMENT` is
the component (``features/base.py``) that checks a config's mode against its engines.
"""

from __future__ import annotations

import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable

PLACEMENTS = ("in_process", "colocated", "separate")


@dataclass(frozen=True)
class SyncMode:
    """One weight-transfer mode; see the module docstring for the fields."""

    name: str
    engine: str
    placement: str
    allows_staleness: bool
    attaches: bool
    topology: str
    help: str = ""
    delta: bool = False
    flat_buckets: bool = False

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"SyncMode {self.name!r}: placement must be one of {PLACEMENTS}, got {self.placement!r}")

    @property
    def colocated(self) -> bool:
        """SGLang engines share the training GPUs (release memory while training, resume for rollout)."""
        return self.placement == "colocated"

    @property
    def separate_gpus(self) -> bool:
        """Engines run on GPUs of their own (or outside the cluster): training offload is pointless."""
        return self.placement == "separate"

    @property
    def in_process(self) -> bool:
        """The engine lives in global rank 0's process."""
        return self.placement == "in_process"

    def build_topology(self) -> Callable[..., Any]:
        """The topology builder ``function(cfg, rank, engine=None, fleet=None) -> SyncTopology`` (imported now)."""
        module, _, fn = self.topology.partition(":")
        return getattr(importlib.import_module(module), fn)


SYNC_MODES: dict[str, SyncMode] = {}


def register_sync_mode(mode: SyncMode) -> SyncMode:
    if mode.name in SYNC_MODES:
        raise ValueError(f"sync mode {mode.name!r} is already registered")
    SYNC_MODES[mode.name] = mode
    return mode


def sync_mode_names() -> tuple[str, ...]:
    """The registered names, in registration order."""
    return tuple(SYNC_MODES)


def modes_where(**props: Any) -> list[str]:
    """Names of the modes whose fields / properties equal ``props`` (e.g. ``engine="sglang"``)."""
    return [m.name for m in SYNC_MODES.values() if all(getattr(m, k) == v for k, v in props.items())]


def sync_mode(name: str, field: str = "rollout.sync_mode") -> SyncMode:
    """The spec registered as ``name``; ValueError (one line naming ``field`` and the registered modes) otherwise."""
    if name in SYNC_MODES:
        return SYNC_MODES[name]
    close = difflib.get_close_matches(str(name), list(SYNC_MODES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{field} must be one of {', '.join(repr(m) for m in SYNC_MODES)}; got {name!r}{hint}")


_TOPOLOGY = "gspo_megatron.weight_sync.topology"
register_sync_mode(
    SyncMode(
        "inprocess",
        engine="hf",
        placement="in_process",
        allows_staleness=False,
        attaches=False,
        topology=f"{_TOPOLOGY}:inprocess_topology",
        help="the in-process transformers engine on rank 0 takes the export stream's buckets (InProcessTransport)",
    )
)
register_sync_mode(
    SyncMode(
        "colocated",
        engine="sglang",
        placement="colocated",
        allows_staleness=False,
        attaches=False,
        topology=f"{_TOPOLOGY}:colocated_topology",
        delta=True,
        flat_buckets=True,
        help="CUDA IPC handles (shared memory on CPU) to engines sharing the training GPUs (CudaIpcTransport)",
    )
)
register_sync_mode(
    SyncMode(
        "disaggregated",
        engine="sglang",
        placement="separate",
        allows_staleness=True,
        attaches=True,
        topology=f"{_TOPOLOGY}:disaggregated_topology",
        delta=True,
        flat_buckets=True,
        help="NCCL broadcast (gloo on CPU) from one source rank per pipeline stage to engines on separate GPUs "
        "(NcclBroadcastTransport); with rollout.sync_delta: the changes in files under rollout.sync_delta_dir, "
        "named to the engines by HTTP (DeltaHttpTransport)",
    )
)


def modes_text(**props: Any) -> str:
    """The sync modes with ``props``, for a message: 'a or b'."""
    return " or ".join(sorted(modes_where(**props)))


class Placement:
    """The component of ``rollout.sync_mode`` (always on: every run has a placement): the mode must
    serve ``rollout.engine``, attached engines need a mode that attaches, launched engines on their own
    GPUs need a count (``features/base.Feature``'s interface; only its config checks)."""

    name = "placement"
    field = "rollout.sync_mode"

    def config_errors(self, cfg) -> list[str]:
        r = cfg.rollout
        sm = SYNC_MODES.get(r.sync_mode)  # None: unknown (only in a Config built in Python; the loader refuses it)
        e = []
        if sm is None or sm.engine != r.engine:
            e.append(
                f"rollout.sync_mode must be {modes_text(engine=r.engine)} with rollout.engine={r.engine}, got {r.sync_mode}"
            )
        if r.engine == "hf" and r.num_engines not in (0, 1):
            e.append(f"rollout.num_engines must be 0 or 1 with rollout.engine=hf, got {r.num_engines}")
        if r.engine_urls and not (sm is not None and sm.attaches):
            e.append(f"rollout.engine_urls needs rollout.sync_mode={modes_text(attaches=True)}")
        if r.engine_urls and r.num_engines not in (0, len(r.engine_urls)):
            e.append(f"rollout.num_engines={r.num_engines} but rollout.engine_urls lists {len(r.engine_urls)} engines")
        if sm is not None and sm.separate_gpus and r.num_engines < 1 and not r.engine_urls:
            e.append(
                f"rollout.num_engines must be >= 1 (or rollout.engine_urls set) with rollout.sync_mode={r.sync_mode}"
            )
        return e


PLACEMENT = Placement()
