"""``rollout.offload_train``: with engines on the training GPUs, the training state (weights, gradients,
optimizer) leaves the GPUs while the engines generate and comes back for the step
(``trainer/offload.py``, driven by ``orchestration/colocation.py``)."""

from __future__ import annotations

from gspo_megatron.features.base import Feature
from gspo_megatron.features.sync_modes import SYNC_MODES, modes_text


class Offload(Feature):
    name = "offload"
    field = "rollout.offload_train"
    metrics = (
        "offload/bytes",
        "offload/offload_s",
        "offload/reload_s",
        "offload/host_bytes",
        "offload/host_alloc_s",
        "offload/host_wait_s",
        "offload/host_grown_bytes",
    )

    def enabled(self, cfg) -> bool:
        return bool(cfg.rollout.offload_train)

    def config_errors(self, cfg) -> list[str]:
        r = cfg.rollout
        sm = SYNC_MODES.get(r.sync_mode)
        if not r.offload_train or sm is None or not sm.separate_gpus:
            return []
        return [
            "rollout.offload_train needs engines on the training devices "
            f"(rollout.sync_mode {modes_text(separate_gpus=False)}), got {r.sync_mode}"
        ]

    def resident_label(self, cfg) -> str:
        """The planner's label of the training state during rollout on a colocated GPU."""
        if not self.enabled(cfg):
            return "training states"
        return "training states (offloaded" + ("; the KL reference model stays)" if cfg.gspo.kl_coef > 0 else ")")


OFFLOAD = Offload()
