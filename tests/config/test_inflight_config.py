"""``rollout.inflight_updates`` (features/inflight.py): the config refusals, one line each naming the
field and what works; the sglang flag its engines need (``in_place``: no radix cache) and the check of
attached engines against it; the pause mode each sync client is built with."""

from __future__ import annotations

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.errors import ConfigError
from gspo_megatron.features import enabled_features
from gspo_megatron.features.inflight import INFLIGHT
from gspo_megatron.fleet.engine_args import attached_engine_errors, config_server_args

DISAGG = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
    "rollout.dynamic_sampling=false",
]
OK = [*DISAGG, "rollout.max_staleness=2"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["rollout.inflight_updates=retract", "rollout.dynamic_sampling=false"],
            r"rollout.inflight_updates=retract needs rollout.sync_mode=disaggregated \(got inprocess\)",
        ),
        (
            [*DISAGG, "rollout.sync_mode=colocated", "rollout.inflight_updates=in_place", "rollout.max_staleness=1"],
            r"rollout.inflight_updates=in_place needs rollout.sync_mode=disaggregated \(got colocated\): .*GPUs of their own",
        ),
        (
            [*DISAGG, "rollout.inflight_updates=abort"],
            r"rollout.inflight_updates=abort needs rollout.max_staleness >= 1",
        ),
        (
            [*OK, "rollout.inflight_updates=retract", "rollout.dynamic_sampling=true"],
            r"rollout.inflight_updates=retract with rollout.dynamic_sampling is not built here yet",
        ),
        (
            [*OK, "rollout.inflight_updates=in_place", "rollout.routing_replay=r3"],
            r"rollout.inflight_updates=in_place with rollout.routing_replay=r3 is not built here yet",
        ),
        ([*OK, "rollout.inflight_groups=-1"], r"rollout.inflight_groups must be >= 0"),
        (
            [*OK, "rollout.inflight_updates=retract", "rollout.prompts_per_step=8", "rollout.inflight_groups=8"],
            r"rollout.inflight_groups=8 must be > rollout.prompts_per_step=8: .*drain every step; e.g. 16, or 0",
        ),
        ([*OK, "rollout.inflight_updates=sometimes"], r"rollout.inflight_updates"),
    ],
)
def test_refusals_name_the_field_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, overrides, check_files=False)
    line = next(x for x in str(e.value).splitlines() if "inflight" in x)
    assert "\n" not in line


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort"])
def test_accepted_and_engine_flags(mode):
    cfg = load_config(None, [*OK, f"rollout.inflight_updates={mode}"], check_files=False)
    assert INFLIGHT in enabled_features(cfg)
    args = config_server_args(cfg, None)
    # in place, requests always run, so sglang never flushes its radix cache: the engines run without one
    assert args.get("disable_radix_cache") is (True if mode == "in_place" else None)
    errors = attached_engine_errors(cfg, None, "http://e0", {"random_seed": cfg.seed})
    if mode == "in_place":
        assert len(errors) == 1 and "disable_radix_cache" in errors[0] and "inflight_updates" in errors[0]
    else:
        assert errors == []


def test_off_by_default():
    cfg = load_config(None, OK, check_files=False)
    assert INFLIGHT not in enabled_features(cfg)
