"""``rollout.max_staleness``: rank 0 generates the next batches while every rank trains (off-policy
overlap, ``orchestration/async_producer.py``); each token's old log-prob comes from the weights of the
version that sampled it (``trainer/behaviour_policy.py``)."""

from __future__ import annotations

from gspo_megatron.features.base import Feature
from gspo_megatron.features.sync_modes import SYNC_MODES, modes_text


class Staleness(Feature):
    name = "staleness"
    field = "rollout.max_staleness"
    metrics = (
        "rollout/staleness_mean",
        "rollout/staleness_max",
        "rollout/engine_policy_version",
        "rollout/trainer_wait_s",
        "rollout/engine_wait_s",
    )

    def enabled(self, cfg) -> bool:
        return cfg.rollout.max_staleness > 0

    def config_errors(self, cfg) -> list[str]:
        r = cfg.rollout
        if r.max_staleness <= 0:
            return []
        sm = SYNC_MODES.get(r.sync_mode)
        e = []
        if sm is None or not sm.allows_staleness:
            e.append(
                f"rollout.max_staleness={r.max_staleness} needs rollout.sync_mode="
                f"{modes_text(allows_staleness=True)} (got {r.sync_mode}): "
                "overlapping generation with training needs engines on their own GPUs; colocated or in-process "
                "engines share the training devices and cannot generate while the trainer trains"
            )
        if r.custom_function is not None:
            e.append(
                "rollout.max_staleness >= 1 with rollout.custom_function is not supported: the hook's records do "
                "not carry the weight version of each token, which off-policy training needs"
            )
        return e


STALENESS = Staleness()
