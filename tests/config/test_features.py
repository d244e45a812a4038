"""The components of features/: each owns its field's checks, engine flags, planner rows and metrics,
and the central modules ask them (config validation, fleet.engine_args, planner)."""

import importlib
import pathlib

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.errors import ConfigError
from gspo_megatron.features import FEATURES, enabled_features, engine_flags, feature_config_errors
from gspo_megatron.features.delta_sync import LOADER_NAME
from gspo_megatron.fleet.engine_args import _CHECKS, config_server_args, config_server_env
from gspo_megatron.models.arch import KNOWN_ARCHS

PKG = pathlib.Path(__file__).resolve().parents[2] / "gspo_megatron"
SGLANG = ["rollout.engine=sglang", "rollout.engine_server=cpu"]


def _source_outside_features() -> str:
    return "\n".join(p.read_text() for p in PKG.rglob("*.py") if "features" not in p.parts)


def test_every_declared_metric_is_written_somewhere_else():
    """A component's ``metrics`` are the names its runtime writes: each must appear as a string literal
    outside features/ (a renamed metric fails here)."""
    src = _source_outside_features()
    missing = [(f.name, m) for f in FEATURES for m in f.metrics if f'"{m}"' not in src]
    assert not missing, missing


def test_every_feature_field_is_a_config_field():
    cfg = load_config(None, [])
    for f in FEATURES:
        section, key = f.field.split(".")
        assert hasattr(getattr(cfg, section), key), f.field
        assert f.enabled(cfg) is False, f"{f.name} is on by default"


def test_delta_loader_name_is_the_loader_sglang_imports():
    module, _, attr = LOADER_NAME.rpartition(".")
    fn = getattr(importlib.import_module(module), attr)
    assert fn.__name__ == "apply_deltas" and module == "gspo_megatron.weight_sync.delta_loader"


def test_engine_flags_are_checked_once_each():
    flags = engine_flags()
    assert set(flags) <= set(_CHECKS)
    for f in FEATURES:
        for name in f.flags:
            assert _CHECKS[name] is f.flags[name]


@pytest.mark.parametrize(
    "overrides, feature, flags",
    [
        (
            ["rollout.routing_replay=r3", "rollout.sync_mode=colocated"],
            "routing_replay",
            {"enable_return_routed_experts"},
        ),
        (["rollout.sync_delta=true", "rollout.sync_mode=colocated"], "delta_sync", {"custom_weight_loader"}),
        (
            ["model.lora.rank=4", "rollout.lora_sync=adapter", "rollout.sync_mode=colocated"],
            "adapter_sync",
            {"enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch", "max_loaded_loras"},
        ),
    ],
)
def test_enabled_component_gives_its_engine_flags(overrides, feature, flags):
    cfg = load_config(None, SGLANG + overrides)
    assert feature in [f.name for f in enabled_features(cfg)]
    args = config_server_args(cfg, dict(KNOWN_ARCHS["tiny-qwen3-moe"]))
    assert flags <= set(args), args
    base = config_server_args(load_config(None, SGLANG + ["rollout.sync_mode=colocated"]), None)
    assert not (flags & set(base))


def test_dsa_indexer_flag_and_env_come_from_routing_replay():
    cfg = load_config(None, SGLANG + ["rollout.routing_replay=r3", "rollout.sync_mode=colocated"])

    class Spec:
        index_topk = 8

    args = config_server_args(cfg, None, route_spec=Spec())
    assert args["enable_return_indexer_topk"] is True
    assert config_server_env(args) == {"SGLANG_DSA_FUSE_TOPK": "0"}
    assert config_server_env({"enable_return_routed_experts": True}) == {}


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["rollout.sync_delta=true"], "rollout.sync_delta"),  # inprocess: no delta
        (["rollout.routing_replay=r3"], "rollout.routing_replay"),  # hf engine
        (["rollout.sync_owner_direct=true"], "rollout.sync_owner_direct"),
        (["rollout.sync_fp8=true"], "rollout.sync_fp8"),
        (
            ["rollout.offload_train=true", *SGLANG, "rollout.sync_mode=disaggregated", "rollout.num_engines=1"],
            "rollout.offload_train",
        ),
        (["rollout.max_staleness=1"], "rollout.max_staleness"),
        (["rollout.lora_sync=adapter"], "rollout.lora_sync"),
    ],
)
def test_each_component_refuses_in_one_line_naming_its_field(overrides, field):
    """The component's own check, and the loader runs it (config/validation.py asks every component)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert field in str(e.value)
    owner = next(f for f in FEATURES if f.field == field)
    cfg = load_config(None, [])  # a valid config, then the one field set as the case does
    for o in overrides:
        key, _, value = o.partition("=")
        section, name = key.split(".", 1)
        if "." in name:
            continue
        current = getattr(getattr(cfg, section), name)
        setattr(getattr(cfg, section), name, type(current)(value) if not isinstance(current, bool) else value == "true")
    errors = owner.config_errors(cfg)
    assert errors and all(field in line and "\n" not in line for line in errors), errors
    assert set(errors) <= set(feature_config_errors(cfg))


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["rollout.engine=sglang", "rollout.sync_mode=inprocess"],
            "rollout.sync_mode must be colocated or disaggregated",
        ),
        (["rollout.engine_urls=[http://a:1]"], "rollout.engine_urls needs rollout.sync_mode=disaggregated"),
        ([*SGLANG, "rollout.sync_mode=disaggregated"], "rollout.num_engines must be >= 1"),
    ],
)
def test_placement_component_checks_the_sync_mode(overrides, expected):
    """The sync-mode registry's own component (always on) refuses a mode that does not serve the engines."""
    from gspo_megatron.features.sync_modes import PLACEMENT

    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert expected in str(e.value)
    assert PLACEMENT.config_errors(load_config(None, [])) == []
