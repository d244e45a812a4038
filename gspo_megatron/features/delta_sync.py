"""``rollout.sync_delta``: each sync sends only the elements that changed since the engines' copy
(``weight_sync/delta.py``), applied by sglang's custom weight loader (``weight_sync/delta_loader.py``,
named to the engines by ``--custom-weight-loader``); disaggregated engines read the changes from files
under ``rollout.sync_delta_dir`` (``weight_sync/delta_http.py``)."""

from __future__ import annotations

from typing import Any

from gspo_megatron.features.base import EngineFlag, Feature, PlanContext
from gspo_megatron.features.fp8_sync import engine_param_bytes
from gspo_megatron.features.sync_modes import SYNC_MODES, modes_text

#: the loader sglang imports by name (``ModelRunner``'s ``custom_weight_loader`` list); defined in
#: weight_sync/delta_loader.py, which the engines import
LOADER_NAME = "gspo_megatron.weight_sync.delta_loader.apply_deltas"


class DeltaSync(Feature):
    name = "delta_sync"
    field = "rollout.sync_delta"
    metrics = (
        "sync/delta_wire_bytes",
        "sync/delta_full_bytes",
        "sync/delta_fraction",
        "sync/delta_tensors_full",
        "sync/delta_engines_rebased",
    )
    flags = {"custom_weight_loader": EngineFlag("rollout.sync_delta", "present")}

    def enabled(self, cfg) -> bool:
        return bool(cfg.rollout.sync_delta)

    def config_errors(self, cfg) -> list[str]:
        r = cfg.rollout
        sm = SYNC_MODES.get(r.sync_mode)
        if not r.sync_delta or sm is None or sm.delta:
            return []
        return [
            f"rollout.sync_delta=true needs rollout.sync_mode={modes_text(delta=True)}, got "
            f"{r.sync_mode}: the engines apply deltas with sglang's custom weight loader "
            "(update_weights_from_tensor); set rollout.sync_delta=false"
        ]

    def engine_args(self, cfg, hf: dict | None, route_spec: Any) -> dict[str, Any]:
        return {"custom_weight_loader": [LOADER_NAME]}

    def host_bytes(self, ctx: PlanContext, kv_tokens: float) -> dict[str, float]:
        """Colocated (``weight_sync/delta.py``): the trainer's copy on an engine's first rank plus the
        engine TP rank's (``delta_loader.py``: its dense tensors and 1/engine_ep of the experts);
        disaggregated (``delta_http.py``): each stage source's copy of its share (the engines' copies
        are on their own hosts)."""
        if ctx.engine_gpu:
            return {}
        r, c = ctx.cfg.rollout, ctx.counts
        per = engine_param_bytes(ctx.cfg)
        if ctx.colocated:
            return {"delta": c.total * per + (c.total - c.expert + c.expert / r.engine_ep) * per}
        return {"delta": c.total * per / ctx.cfg.parallel.pp}


DELTA_SYNC = DeltaSync()
