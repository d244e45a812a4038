"""``rollout.routing_replay``: values (YAML's bare ``off`` included) and the refusals, one line naming the field."""

from __future__ import annotations

import pytest

from gspo_megatron.config import load_config, validate_model_layout
from gspo_megatron.errors import ConfigError
from gspo_megatron.models.arch import KNOWN_ARCHS

SGLANG_CPU = ["rollout.engine=sglang", "rollout.engine_server=cpu", "rollout.sync_mode=colocated"]


def test_values_and_yaml_off(tmp_path):
    assert load_config(None, []).rollout.routing_replay == "off"
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  routing_replay: off\n")  # YAML 1.1 reads a bare off as false
    assert load_config(str(path), []).rollout.routing_replay == "off"
    assert load_config(None, ["rollout.routing_replay=r2"]).rollout.routing_replay == "r2"
    assert load_config(None, [*SGLANG_CPU, "rollout.routing_replay=r3"]).rollout.routing_replay == "r3"
    # multi-turn custom rollouts carry each call's routes (engines.routing.compose_routes)
    cfg = load_config(
        None, [*SGLANG_CPU, "rollout.routing_replay=r3", "rollout.custom_function=x.py:f"], check_files=False
    )
    assert cfg.rollout.custom_function == "x.py:f"
    with pytest.raises(ConfigError, match="rollout.routing_replay must be one of"):
        load_config(None, ["rollout.routing_replay=r4"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rollout.routing_replay=r3"], "rollout.routing_replay=r3 needs rollout.engine=sglang"),
    ],
)
def test_refusals(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


@pytest.mark.parametrize("mode", ["r2", "r3"])
def test_recompute_is_accepted(mode):
    """Replay holds in the forward recomputed in backward (tests/pipeline/test_route_replay_recompute.py)."""
    extra = SGLANG_CPU if mode == "r3" else []
    cfg = load_config(None, [*extra, f"rollout.routing_replay={mode}", "model.recompute=true"])
    assert cfg.model.recompute and cfg.rollout.routing_replay == mode


def test_dense_model_refused():
    from gspo_megatron.models.tiny import TINY_CONFIGS

    dense = TINY_CONFIGS["qwen3"]
    cfg = load_config(None, ["rollout.routing_replay=r2"])
    with pytest.raises(ConfigError, match="rollout.routing_replay=r2 needs an MoE model"):
        validate_model_layout(cfg, dense)
    validate_model_layout(cfg, KNOWN_ARCHS["tiny-qwen3-moe"])  # an MoE model is fine
