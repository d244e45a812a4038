"""The component interface: one object per sync or rollout feature, asked by the config's checks, the
planner, the engine flags and the session instead of being named in each of them.

A component owns, for its feature:
- ``config_errors(cfg)`` and ``model_errors(cfg, dims)``: its field's checks and its refusals of other components' settings (one line
  each, naming the fields and what works), run for every config by ``config.validation``;
- ``engine_args(cfg, hf, route_spec)`` / ``engine_env(args)``: the sglang ``ServerArgs`` fields (and the
  environment) its engines need, with ``flags``: how an attached engine's ``/server_info`` value of each
  is checked (``fleet/engine_args.py`` asks every enabled component);
- the planner's rows (``train_rows``, ``engine_budget_rows``, ``rollout_rows``, ``host_bytes``,
  ``notes``) and the KV bytes per token it adds to an engine GPU (``engine_kv_bytes_per_token``), given a
  :class:`PlanContext`, and ``rollout_advice``: its settings that would fit a
  rollout phase over memory (``plan_report``);
- ``metrics``: the metric names it writes (docs/training.md).

Components read the config as an object (``cfg.rollout.sync_delta``...): they import no ``config``
module at run time, so ``config/validation.py`` (one floor up) can ask them. Adding a feature: its
module here with one :class:`Feature` subclass, one line in ``features/__init__.py``, its tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GIB = float(2**30)
Row = tuple[str, float]  # (label, bytes)


@dataclass(frozen=True)
class EngineFlag:
    """How an attached engine's value of one sglang flag is checked against the wanted one. ``field``:
    the config field that needs the flag (named in the error). ``compare``: ``"equal"``, ``"at_least"``
    (a capacity: a number no smaller), ``"present"`` (a list holding every wanted entry) or
    ``"unchecked"`` (the flag only records or tunes). ``unlimited``: engine values that satisfy any want."""

    field: str
    compare: str = "equal"
    unlimited: tuple = ()

    def __post_init__(self):
        if self.compare not in ("equal", "at_least", "present", "unchecked"):
            raise ValueError(f"EngineFlag({self.field!r}): unknown compare {self.compare!r}")


@dataclass(frozen=True)
class PlanContext:
    """What the planner knows of one GPU when it asks a component for rows (bytes, per GPU).

    ``dims``: the planner's ``ModelDims``; ``counts``: its ``ParamCounts`` (total / expert parameters);
    ``dp``: the training data-parallel size; ``stage_layers``: the layers of a pipeline stage;
    ``colocated``: the engines share the training GPUs; ``engine_gpu``: the GPU planned is an engine's
    own (disaggregated), not a training GPU; ``adapter_params``: the LoRA adapters' parameters of the
    whole model at ``model.lora.rank`` (0 without LoRA); ``stage``: the pipeline stage planned (its
    GPUs are global ranks ``stage * tp * cp * dp`` onwards: pipeline is the slowest rank dimension);
    ``mtp_layers``: the checkpoint's MTP layers, ``mtp_layer_params`` the parameters of one (its decoder
    layer, every routed expert included, ``eh_proj`` and norms; the embedding and head are the target's),
    ``kv_bytes_per_layer``: what one attention layer keeps per token of an engine's KV cache on one GPU."""

    cfg: Any
    dims: Any
    counts: Any
    dp: int
    gpu_bytes: float
    gpus_per_node: int
    stage_layers: int
    colocated: bool
    engine_gpu: bool = False
    adapter_params: int = 0
    stage: int = 0
    mtp_layers: int = 0
    mtp_layer_params: float = 0.0
    kv_bytes_per_layer: float = 0.0


def floor2(x: float) -> str:
    """``x`` rounded down to two decimals (a memory fraction that still fits)."""
    return f"{math.floor(x * 100) / 100:.2f}"


class Feature:
    """One sync or rollout feature (module docstring). Subclasses set ``name``, ``field`` and
    ``metrics`` and override the hooks they need; every hook's default adds nothing."""

    name: str = ""
    field: str = ""  # the config field that turns it on
    metrics: tuple[str, ...] = ()
    flags: dict[str, EngineFlag] = {}

    def enabled(self, cfg) -> bool:
        raise NotImplementedError

    def config_errors(self, cfg) -> list[str]:
        """One line per problem of this feature's setting in ``cfg`` (run for every config)."""
        return []

    def model_errors(self, cfg, dims: Any) -> list[str]:
        """One line per problem of this (enabled) feature with the model (``models.dims.ModelDims``),
        run by ``config.validation.validate_model_layout``."""
        return []

    def engine_args(self, cfg, hf: dict | None, route_spec: Any) -> dict[str, Any]:
        """The sglang ServerArgs fields this feature needs (called when enabled); keys are in ``flags``.
        ``hf``: the model's config.json (None: unknown); ``route_spec``: ``engines.routing.route_spec_of(hf)``
        when the caller has it already, else None."""
        return {}

    def engine_env(self, args: dict[str, Any]) -> dict[str, str]:
        """The environment an engine started with ``args`` needs for this feature."""
        return {}

    def train_rows(self, ctx: PlanContext) -> list[Row]:
        """Training-phase rows on a training GPU (called when enabled)."""
        return []

    def engine_budget_rows(self, ctx: PlanContext) -> list[Row]:
        """Rows inside the engines' ``rollout.engine_mem_fraction`` (before the KV cache takes the rest)."""
        return []

    def engine_kv_bytes_per_token(self, ctx: PlanContext) -> float:
        """Bytes per token this feature adds to each engine GPU's KV cache (a draft model's own layers)."""
        return 0.0

    def rollout_rows(self, ctx: PlanContext, kv_tokens: float) -> list[Row]:
        """Rollout-phase rows beyond the engines' budget; ``kv_tokens``: the KV cache's capacity in tokens."""
        return []

    def host_bytes(self, ctx: PlanContext, kv_tokens: float) -> dict[str, float]:
        """Host memory per GPU by kind (``"delta"``, ``"capture"``: ``planner.StageMemory.host_*``)."""
        return {}

    def rollout_advice(self, cfg, over_fraction: float) -> list[str]:
        """Settings of this (enabled) feature that would fit a rollout phase over the GPU's memory by
        ``over_fraction`` of it (``plan_report``'s advice when the plan does not fit)."""
        return []

    def notes(self, ctx: PlanContext) -> list[str]:
        """Lines for the plan's notes."""
        return []
