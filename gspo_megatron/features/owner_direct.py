"""``rollout.sync_owner_direct``: with colocated engines, each expert's owner hands its weights to the
engine ranks on its node through CUDA IPC of its own holder buffers (``weight_sync/owner_direct.py``),
instead of a gather to one rank per engine."""

from __future__ import annotations

from gspo_megatron.features.base import GIB, Feature, PlanContext, Row
from gspo_megatron.features.sync_modes import SYNC_MODES, modes_text

#: one CUDA context that a process creates on a GPU not its own when it opens a CUDA IPC handle of
#: memory there (an engine TP process opening a holder's buffer on another GPU of the node). 0.3-0.5 GiB
#: on H100s with CUDA 12's lazy loading (reported, not measured here: docs/gpu.md;
#: tests/gpu/test_ipc_foreign_context_gpu.py measures it); the upper end is planned for
FOREIGN_CONTEXT_GIB = 0.5


class OwnerDirect(Feature):
    name = "owner_direct"
    field = "rollout.sync_owner_direct"

    def enabled(self, cfg) -> bool:
        return bool(cfg.rollout.sync_owner_direct)

    def config_errors(self, cfg) -> list[str]:
        r = cfg.rollout
        sm = SYNC_MODES.get(r.sync_mode)
        if not r.sync_owner_direct or sm is None or sm.colocated:
            return []
        return [
            f"rollout.sync_owner_direct=true needs rollout.sync_mode={modes_text(placement='colocated')}, "
            f"got {r.sync_mode}: the expert owners hand their weights to the engine ranks on their node; set "
            "rollout.sync_owner_direct=false"
        ]

    def _contexts(self, ctx: PlanContext) -> list[Row]:
        """The engine processes of the other GPUs of the node open CUDA IPC handles of this GPU's holder
        buffers, each creating a CUDA context here (:data:`FOREIGN_CONTEXT_GIB`), on top of the engine's
        budget (made at sync time, after the KV cache) and kept through training
        (``release_memory_occupation`` frees no context). At most one per other GPU of the node."""
        others = max(ctx.gpus_per_node - 1, 0)
        if not ctx.colocated or not others:
            return []
        return [
            (
                f"owner-direct sync: {others} foreign CUDA contexts ({FOREIGN_CONTEXT_GIB} GiB each)",
                others * FOREIGN_CONTEXT_GIB * GIB,
            )
        ]

    def train_rows(self, ctx: PlanContext) -> list[Row]:
        return self._contexts(ctx)  # the contexts stay while the engines' memory is released

    def rollout_rows(self, ctx: PlanContext, kv_tokens: float) -> list[Row]:
        return self._contexts(ctx)


OWNER_DIRECT = OwnerDirect()
