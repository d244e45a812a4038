"""The sync and rollout features as components (``features/base.py``: what each owns), registered here
in the one order every caller sees them (the planner's rows and the engine flags follow it).

- ``sync_modes``: the placement registry (``rollout.sync_mode``), a table the others consult, and its
  component ``PLACEMENT`` (the mode's checks; always on);
- ``delta_sync``, ``fp8_sync``, ``owner_direct``, ``adapter_sync``: how a sync sends the weights;
- ``routing_replay``, ``offload``, ``staleness``, ``inflight``: how a step rolls out and trains;
- ``speculative``: the engines decode speculatively with the checkpoint's MTP layer as the draft, and
  ``model.mtp`` (the MTP layer trained and synced);
- ``distill``: teachers score the student's rollouts (on-policy distillation).

``config/validation.py``, ``planner.py``, ``plan_report.py`` and ``fleet/engine_args.py`` ask
:data:`FEATURES` (or :func:`enabled_features`) instead of naming a feature.
"""

from __future__ import annotations

from gspo_megatron.features.adapter_sync import ADAPTER_SYNC
from gspo_megatron.features.base import EngineFlag, Feature, PlanContext
from gspo_megatron.features.delta_sync import DELTA_SYNC
from gspo_megatron.features.distill import DISTILL
from gspo_megatron.features.fp8_sync import FP8_SYNC
from gspo_megatron.features.inflight import INFLIGHT
from gspo_megatron.features.offload import OFFLOAD
from gspo_megatron.features.owner_direct import OWNER_DIRECT
from gspo_megatron.features.routing_replay import ROUTING_REPLAY
from gspo_megatron.features.speculative import SPECULATIVE
from gspo_megatron.features.staleness import STALENESS
from gspo_megatron.features.sync_modes import PLACEMENT

FEATURES: tuple[Feature, ...] = (
    ROUTING_REPLAY,
    OWNER_DIRECT,
    ADAPTER_SYNC,
    DELTA_SYNC,
    FP8_SYNC,
    OFFLOAD,
    STALENESS,
    INFLIGHT,
    SPECULATIVE,
    DISTILL,
)


def enabled_features(cfg) -> list[Feature]:
    """The registered features ``cfg`` turns on, in registration order."""
    return [f for f in FEATURES if f.enabled(cfg)]


def feature_config_errors(cfg) -> list[str]:
    """Every component's checks of ``cfg`` (each names its fields): the placement's
    (``features/sync_modes.PLACEMENT``, always on), then each feature's in registration order."""
    return PLACEMENT.config_errors(cfg) + [e for f in FEATURES for e in f.config_errors(cfg)]


def engine_flags() -> dict[str, EngineFlag]:
    """Every flag a component can ask the engines for, with how an attached engine's value is checked."""
    out: dict[str, EngineFlag] = {}
    for f in FEATURES:
        for name, flag in f.flags.items():
            if name in out:
                raise ValueError(f"engine flag {name!r} claimed by two features ({f.name})")
            out[name] = flag
    return out


__all__ = [
    "FEATURES",
    "EngineFlag",
    "Feature",
    "PlanContext",
    "enabled_features",
    "engine_flags",
    "feature_config_errors",
]
