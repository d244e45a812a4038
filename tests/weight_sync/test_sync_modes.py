"""The SyncMode registry (features/sync_modes.py): one spec per mode drives the config's checks, the
planner and the topology builder; a mode registered by a test is checked by its properties alone."""

from __future__ import annotations

import dataclasses

import pytest

from gspo_megatron.config import engine_count, load_config, validate
from gspo_megatron.errors import ConfigError
from gspo_megatron.features import sync_modes as modes
from gspo_megatron.features.sync_modes import SyncMode, sync_mode, sync_mode_names

DELTA = ["rollout.engine=sglang", "rollout.sync_mode=delta_test", "rollout.num_engines=1"]


@pytest.fixture
def registry():
    """The registry, restored after the test: what it registers is gone afterwards."""
    saved = dict(modes.SYNC_MODES)
    yield modes.SYNC_MODES
    modes.SYNC_MODES.clear()
    modes.SYNC_MODES.update(saved)


def test_builtin_modes_and_their_builders():
    assert sync_mode_names()[:3] == ("inprocess", "colocated", "disaggregated")
    for name in sync_mode_names():
        assert callable(sync_mode(name).build_topology()), name
    assert [m for m in sync_mode_names() if sync_mode(m).colocated] == ["colocated"]
    assert [m for m in sync_mode_names() if sync_mode(m).allows_staleness] == ["disaggregated"]


def test_unknown_mode_is_refused_in_one_line_naming_field_and_modes():
    with pytest.raises(ValueError) as e:
        sync_mode("delta")
    assert str(e.value) == "rollout.sync_mode must be one of 'inprocess', 'colocated', 'disaggregated'; got 'delta'"
    with pytest.raises(ConfigError) as c:
        load_config(None, ["rollout.engine=sglang", "rollout.sync_mode=colocate"])
    assert c.value.errors == [
        "rollout.sync_mode must be one of 'inprocess', 'colocated', 'disaggregated'; "
        "got 'colocate'; did you mean 'colocated'?"
    ]


def test_properties_drive_validation(registry):
    base = sync_mode("disaggregated")
    modes.register_sync_mode(dataclasses.replace(base, name="delta_test", allows_staleness=False, attaches=False))
    cfg = load_config(None, DELTA)  # a registered name is a valid value
    assert cfg.rollout.sync_mode == "delta_test" and engine_count(cfg, 4) == 1
    with pytest.raises(
        ConfigError, match="rollout.max_staleness=1 needs rollout.sync_mode=disaggregated \\(got delta_test\\)"
    ):
        load_config(None, DELTA + ["rollout.max_staleness=1"])
    with pytest.raises(ConfigError, match="rollout.engine_urls needs rollout.sync_mode=disaggregated"):
        load_config(None, DELTA + ["rollout.engine_urls=[http://a:1]", "rollout.num_engines=0"])
    with pytest.raises(ConfigError, match="offload_train needs engines on the training devices .*got delta_test"):
        load_config(None, DELTA + ["rollout.offload_train=true"])
    with pytest.raises(ConfigError, match="rollout.sync_mode must be inprocess with rollout.engine=hf, got delta_test"):
        load_config(None, ["rollout.sync_mode=delta_test"])

    registry["delta_test"] = dataclasses.replace(registry["delta_test"], allows_staleness=True)
    assert load_config(None, DELTA + ["rollout.max_staleness=1"]).rollout.max_staleness == 1

    registry["delta_test"] = dataclasses.replace(registry["delta_test"], placement="colocated")
    cfg = load_config(None, DELTA[:2] + ["rollout.engine_tp=3", "rollout.offload_train=true"])
    assert engine_count(cfg, 6) == 2  # colocated: world / engine_tp
    with pytest.raises(ConfigError, match="rollout.engine_tp=3 must divide the number of training GPUs 4"):
        validate(cfg, 4)


def test_registry_refuses_a_duplicate_and_a_bad_placement(registry):
    with pytest.raises(ValueError, match="'colocated' is already registered"):
        modes.register_sync_mode(sync_mode("colocated"))
    with pytest.raises(ValueError, match="placement must be one of"):
        SyncMode("x", engine="sglang", placement="remote", allows_staleness=False, attaches=False, topology="m:f")
