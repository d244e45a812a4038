"""``rollout.speculative`` / ``model.mtp`` (features/speculative.py): the config refusals, one line each naming
the field and what works; the model refusals (``models.mtp.mtp_errors``) on the checkpoint's config.json;
``model.mtp=false`` with speculative decoding allowed (the engines keep the checkpoint's own draft)."""

from __future__ import annotations

import json
import os

import pytest

from gspo_megatron.config import load_config, validate_model_layout
from gspo_megatron.errors import ConfigError
from gspo_megatron.features import enabled_features
from gspo_megatron.features.speculative import SPECULATIVE, speculative_server_args

SGLANG = ["rollout.engine=sglang", "rollout.engine_server=cpu", "rollout.sync_mode=colocated"]
SPEC = [*SGLANG, "rollout.speculative=true"]
# the published draft (model.mtp=false) needs engines that keep their weights between rollouts
FROZEN = [*SPEC, "rollout.sync_mode=disaggregated", "rollout.num_engines=1", "model.mtp=false"]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["rollout.speculative=true"], r"rollout.speculative=true needs rollout.engine=sglang .*got hf"),
        ([*SPEC, "rollout.speculative_steps=0"], r"rollout.speculative_steps=0 must be >= 1"),
        (
            ["gspo.mtp_loss_coef=0.3"],
            r"gspo.mtp_loss_coef=0.3 needs the MTP layer in the trained model: set model.mtp=true",
        ),
        ([*SPEC, "model.mtp=false", "gspo.mtp_loss_coef=0.1"], r"gspo.mtp_loss_coef=0.1 needs the MTP layer"),
        (
            [*SPEC, "model.lora.rank=4", "model.lora.alpha=8", "rollout.lora_sync=adapter"],
            r"model.mtp=true with rollout.lora_sync=adapter: .*set model.mtp=false .*or rollout.lora_sync=merged",
        ),
        ([*SPEC, "model.lora.rank=4", "model.lora.alpha=8"], r"model.mtp=true with model.lora: .*not built yet"),
        (
            [*SPEC, "model.mtp=false"],
            r"model.mtp=false and rollout.sync_mode=colocated: colocated engines release their weights .*"
            r"set model.mtp=true .* or a disaggregated rollout.sync_mode",
        ),
    ],
)
def test_refusals_name_the_field_in_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, overrides, check_files=False)
    line = next(x for x in str(e.value).splitlines() if "speculative" in x or "mtp" in x)
    assert "\n" not in line


@pytest.mark.parametrize(
    "overrides",
    [
        SPEC,  # model.mtp null: on with speculative
        FROZEN,  # the engines draft with the published MTP layer
        [*SPEC, "gspo.mtp_loss_coef=0.5", "rollout.speculative_steps=1"],
        [*SGLANG, "model.mtp=true", "gspo.mtp_loss_coef=0.1"],  # trained and synced, no speculation
        [*SPEC, "rollout.routing_replay=r3", "rollout.engine_deterministic=true"],  # sglang refuses neither
        [*FROZEN, "model.lora.rank=4", "model.lora.alpha=8", "rollout.lora_sync=adapter"],
    ],
)
def test_accepted(overrides):
    cfg = load_config(None, overrides, check_files=False)
    assert SPECULATIVE in enabled_features(cfg)


def test_flags_and_enabled():
    cfg = load_config(None, [*SPEC, "rollout.speculative_steps=2"], check_files=False)
    assert cfg.mtp_in_model
    assert (
        SPECULATIVE.engine_args(cfg, None, None)
        == speculative_server_args(2)
        == {
            "speculative_algorithm": "EAGLE",
            "speculative_num_steps": 2,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": 3,
        }
    )
    trained = load_config(None, [*SGLANG, "model.mtp=true"], check_files=False)
    assert SPECULATIVE.enabled(trained) and SPECULATIVE.engine_args(trained, None, None) == {}
    assert not SPECULATIVE.enabled(load_config(None, SGLANG, check_files=False))


def _tiny_dir(tmp_path, family, **overrides):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    d = str(tmp_path / family)
    save_tiny_hf_model(family, d, seed=0, **overrides)
    with open(os.path.join(d, "config.json")) as f:
        return d, json.load(f)


@pytest.mark.parametrize(
    "family, extra, mtp, ok",
    [
        ("glm4_moe", {"num_nextn_predict_layers": 1}, None, True),
        ("deepseek_v3", {"num_nextn_predict_layers": 1}, "false", True),
        ("glm4_moe", {"num_nextn_predict_layers": 0}, None, False),  # no MTP layer: nothing to draft with
        ("glm4_moe", {"num_nextn_predict_layers": 0}, "false", False),  # the published draft must exist too
        ("qwen3_moe", {}, None, False),  # a family without MTP support
        ("glm4_moe", {"num_nextn_predict_layers": 2}, None, False),  # sglang's NextN loader takes one layer
    ],
)
def test_model_refusals_come_from_models_mtp(tmp_path, family, extra, mtp, ok):
    d, hf = _tiny_dir(tmp_path, family, **extra)
    overrides = [*(FROZEN if mtp == "false" else SPEC), f"model.hf_path={d}"]
    cfg = load_config(None, overrides, check_files=False)
    if ok:
        validate_model_layout(cfg, hf)
        return
    with pytest.raises(ConfigError) as e:
        validate_model_layout(cfg, hf)
    lines = [x for x in str(e.value).splitlines() if "rollout.speculative=true" in x or "model.mtp" in x]
    assert lines, str(e.value)


def test_layouts_the_mtp_layer_is_not_built_for(tmp_path):
    d, hf = _tiny_dir(tmp_path, "deepseek_v3", num_nextn_predict_layers=1, tie_word_embeddings=True)
    cfg = load_config(None, [*SPEC, f"model.hf_path={d}", "parallel.pp=2"], check_files=False)
    with pytest.raises(ConfigError, match=r"tie_word_embeddings=true needs parallel.pp=1 \(got 2\)"):
        validate_model_layout(cfg, hf)
    frozen = load_config(None, [*FROZEN, f"model.hf_path={d}", "parallel.pp=2"], check_files=False)
    validate_model_layout(frozen, hf)  # the published draft: no MTP layer in the trained model
    d, hf = _tiny_dir(tmp_path / "untied", "glm4_moe", num_nextn_predict_layers=1)
    validate_model_layout(load_config(None, [*SPEC, f"model.hf_path={d}", "parallel.pp=2"], check_files=False), hf)
