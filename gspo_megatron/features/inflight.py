"""``rollout.inflight_updates``: engines that never drain. The producer keeps
``rollout.inflight_groups`` prompt groups generating; a step trains on the groups that finished; each
weight sync pauses the engines in sglang's ``/pause_generation`` mode of that name, updates and
continues, with requests still in the engines (``orchestration/inflight.py``). Every token carries
the version that sampled it (sglang 0.5.23's ``meta_info.weight_versions``); the trainer's old
log-prob of each token is its version's forward (``trainer/behaviour_policy.py``), except where no
single version sampled it (``in_place``: a token sampled over a prefix whose KV cache older weights
computed) and the engine's log-prob is the behaviour's.

Why the radix cache is off in ``in_place`` mode: sglang refuses ``/flush_cache`` while requests run,
and in-place engines always have requests running, so prefixes cached under old weights (the chat
template, a group's prompt) would be reused by requests admitted after an update, and their tokens
would be sampled over stale KV without any span saying so. With ``--disable-radix-cache`` a request
admitted after an update is prefilled under the weights it is sampled with.
"""

from __future__ import annotations

from typing import Any

from gspo_megatron.features.base import EngineFlag, Feature
from gspo_megatron.features.sync_modes import SYNC_MODES, modes_text

MODES = ("in_place", "retract", "abort")


def inflight_slots(rollout) -> int:
    """The prompt groups an in-flight producer keeps generating or finished and not yet trained:
    ``rollout.inflight_groups``, 0 meaning ``2 * prompts_per_step`` (``orchestration/inflight.py``)."""
    return int(rollout.inflight_groups or 2 * rollout.prompts_per_step)


class Inflight(Feature):
    name = "inflight"
    field = "rollout.inflight_updates"
    flags = {"disable_radix_cache": EngineFlag("rollout.inflight_updates=in_place")}
    metrics = (
        "rollout/version_span_max",
        "rollout/version_span_mean",
        "rollout/stale_token_frac",
        "rollout/engine_behaviour_tokens",
        "rollout/stale_groups_dropped",
        "rollout/carried_groups",
        "rollout/engine_busy_frac",
        "rollout/resubmitted_samples",
    )

    def enabled(self, cfg) -> bool:
        return cfg.rollout.inflight_updates != "off"

    def config_errors(self, cfg) -> list[str]:
        r = cfg.rollout
        e = []
        if r.inflight_groups < 0:
            e.append(f"rollout.inflight_groups must be >= 0 (0 = 2 * prompts_per_step), got {r.inflight_groups}")
        if r.inflight_updates == "off":
            return e
        if 0 < r.inflight_groups <= r.prompts_per_step:
            e.append(
                f"rollout.inflight_groups={r.inflight_groups} must be > rollout.prompts_per_step="
                f"{r.prompts_per_step}: it counts the groups generating and those finished and not yet trained, "
                f"so with a step's groups or fewer the engines drain every step; e.g. {2 * r.prompts_per_step}, "
                "or 0 (= 2 * prompts_per_step)"
            )
        mode = f"rollout.inflight_updates={r.inflight_updates}"
        sm = SYNC_MODES.get(r.sync_mode)
        if sm is None or sm.colocated or sm.engine != "sglang" or not sm.allows_staleness:
            e.append(
                f"{mode} needs rollout.sync_mode={modes_text(allows_staleness=True)} (got {r.sync_mode}): "
                "engines that generate through the trainer's step need GPUs of their own; colocated engines "
                "release their memory while the trainer trains"
            )
        if r.max_staleness < 1:
            e.append(
                f"{mode} needs rollout.max_staleness >= 1 (got {r.max_staleness}): a sample generating through a "
                "sync holds tokens of the previous version when it is trained; 1 or 2 keeps them fresh"
            )
        if r.dynamic_sampling:
            e.append(f"{mode} with rollout.dynamic_sampling is not built here yet: set rollout.dynamic_sampling=false")
        if r.routing_replay != "off":
            e.append(
                f"{mode} with rollout.routing_replay={r.routing_replay} is not built here yet: the routes of a "
                "request that lives through an update mix weight versions; set rollout.routing_replay=off"
            )
        return e

    def engine_args(self, cfg, hf: dict | None, route_spec: Any) -> dict[str, Any]:
        return {"disable_radix_cache": True} if cfg.rollout.inflight_updates == "in_place" else {}


INFLIGHT = Inflight()
