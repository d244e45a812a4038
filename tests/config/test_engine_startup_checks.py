"""sglang 0.5.23's start-up refusals of the flags a config derives (``fleet/engine_startup_checks.py``),
checked at ``--check`` time (issue 32 defect 2): ``rollout.routing_replay=r3`` on a DSA model asks the
engines for ``--enable-return-indexer-topk``, whose ``IndexerTopkCapturer`` asserts ``attn_tp_size == 1``
(``state_capturer/indexer_topk.py``: DP attention only) in every engine process; the trainer's engines
run ``--tp-size rollout.engine_tp`` without attention DP, so ``engine_tp > 1`` aborts them. The config
is refused in one line naming the fields and what works; every config the validation accepts parses in
sglang's own ``ServerArgs`` and passes the restated start-up checks."""

from __future__ import annotations

import importlib.util
import itertools
import os

import pytest

from gspo_megatron.config import load_config, validate_model_layout
from gspo_megatron.errors import ConfigError
from gspo_megatron.fleet.engine_startup_checks import (
    INDEXER_CAPTURER_ASSERT,
    attn_tp_size,
    launch_args,
    server_args_errors,
    sglang_cli_errors,
    startup_errors,
    startup_refusals,
)
from gspo_megatron.models.arch import KNOWN_ARCHS
from tiny_models import tiny_hf_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_SPEC = importlib.util.find_spec("sglang")
SGLANG_DIR = _SPEC.submodule_search_locations[0] if _SPEC else None
needs_sglang = pytest.mark.skipif(SGLANG_DIR is None, reason="sglang (installed --no-deps) not found")
RECIPES = {"deepseek-v3.2": "configs/deepseek_v32_gspo.yaml", "glm-5": "configs/glm5_gspo.yaml"}
R3 = ["rollout.routing_replay=r3", "model.recompute=false"]  # (r3 + recompute: another check's business)


def _check(cfg, hf):
    """What ``gspo-train --check`` and the planner run: the layout checks, then sglang's start-up rules."""
    validate_model_layout(cfg, hf)
    startup_refusals(cfg, hf)


def _recipe(arch, *overrides):
    return load_config(os.path.join(REPO, RECIPES[arch]), list(overrides), check_files=False)


@pytest.mark.parametrize("arch", sorted(RECIPES))
def test_dsa_r3_with_engine_tp_above_one_is_refused_in_one_line(arch):
    cfg = _recipe(arch, *R3)
    assert cfg.rollout.engine_tp == 16
    with pytest.raises(ConfigError) as err:
        _check(cfg, KNOWN_ARCHS[arch])
    msg = str(err.value).strip()
    assert "\n" not in msg, msg
    for part in ("rollout.routing_replay=r3", "rollout.engine_tp=16", KNOWN_ARCHS[arch]["model_type"]):
        assert part in msg
    # what would work, named
    assert "rollout.routing_replay=r2" in msg and "rollout.engine_tp=1" in msg
    assert INDEXER_CAPTURER_ASSERT in msg


@pytest.mark.parametrize("arch", sorted(RECIPES))
def test_the_values_the_refusal_names_pass(arch):
    hf = KNOWN_ARCHS[arch]
    _check(_recipe(arch), hf)  # the recipes as shipped (replay off)
    _check(_recipe(arch, "rollout.routing_replay=r2"), hf)
    assert startup_errors(_recipe(arch, *R3, "rollout.engine_tp=1", "rollout.num_engines=0"), hf) == []


def test_the_cpu_stand_in_is_refused_as_sglang_and_non_dsa_models_are_not():
    dsa = tiny_hf_config("deepseek_v32")
    base = ["rollout.engine=sglang", "rollout.sync_mode=colocated", "rollout.engine_tp=2", *R3]
    cpu = load_config(None, [*base, "rollout.engine_server=cpu"], check_files=False)
    assert len(startup_errors(cpu, dsa)) == 1  # the CPU server asserts as sglang's capturer does
    gpu = load_config(None, base, check_files=False)
    assert len(startup_errors(gpu, dsa)) == 1
    assert startup_errors(gpu, tiny_hf_config("qwen3_moe")) == []  # routes only: no indexer capturer


def test_attention_layouts_as_sglang_derives_them():
    assert attn_tp_size({"tp_size": 16}) == 16
    assert attn_tp_size({"tp_size": 16, "attn_dp_size": 16}) == 1
    assert attn_tp_size({"tp_size": 16, "attn_dp_size": 4}) == 4
    assert attn_tp_size({"tp_size": 16, "enable_dp_attention": True, "dp_size": 16}) == 1  # the old spelling
    topk = {"enable_return_indexer_topk": True}
    assert server_args_errors({"tp_size": 16, "attn_dp_size": 16, **topk}) == []
    assert server_args_errors({"tp_size": 1, **topk}) == []
    (err,) = server_args_errors({"tp_size": 8, **topk})
    assert "attn_tp_size" in err and "got 8" in err
    (err,) = server_args_errors({"tp_size": 8, "attn_dp_size": 3})
    assert "must divide --tp-size 8" in err
    (err,) = server_args_errors({"tp_size": 8, "attn_dp_size": 8, "dp_size": 2})
    assert "--dp-size 2 with --attn-dp-size 8" in err


@needs_sglang
def test_the_restated_checks_match_sglangs_source():
    """The capturer's assert and the attention-TP formula as the installed sglang has them."""
    with open(os.path.join(SGLANG_DIR, "srt/state_capturer/indexer_topk.py")) as f:
        src = f.read()
    assert f'assert attn_tp_size == 1, "{INDEXER_CAPTURER_ASSERT}"' in src
    assert "attn_tp_size = get_parallel().attn_tp_size" in src
    from sglang.srt.runtime_context import derive_attn_tp_size

    for tp, dp, cp in itertools.product((1, 2, 8, 16), (1, 2, 8, 16), (1, 2)):
        if tp % (dp * cp) == 0:
            got = attn_tp_size({"tp_size": tp, "attn_dp_size": dp, "attn_cp_size": cp})
            assert got == derive_attn_tp_size(tp_size=tp, attn_cp_size=cp, attn_dp_size=dp)
    with open(os.path.join(SGLANG_DIR, "srt/arg_groups/parallel_hook.py")) as f:
        hook = f.read()
    assert "assert cfg.tp_size % cfg.attn_dp_size == 0" in hook
    assert "data-parallel replicas combined with attention data parallelism" in hook


@needs_sglang
def test_sglang_parses_the_refused_layout_and_the_check_restates_its_abort():
    cfg = _recipe("deepseek-v3.2", *R3)
    args = launch_args(cfg, KNOWN_ARCHS["deepseek-v3.2"])
    assert args["tp_size"] == 16 and args["enable_return_indexer_topk"]
    errors = sglang_cli_errors(args)
    assert errors is not None and len(errors) == 1 and INDEXER_CAPTURER_ASSERT in errors[0], errors
    # the layout sglang's capturer accepts, in the new and the deprecated spelling
    assert sglang_cli_errors({**args, "attn_dp_size": 16}) == []
    assert sglang_cli_errors({**args, "enable_dp_attention": True, "dp_size": 16}) == []
    bad = sglang_cli_errors({**args, "not_a_sglang_flag": 1})
    assert bad and "unrecognized arguments" in bad[0]


# every flag combination config_server_args can derive: (overrides, model family)
_FEATURES = {
    "plain": [],
    "deterministic": ["rollout.engine_deterministic=true"],
    "ep": ["rollout.engine_tp=2", "rollout.engine_ep=2"],
    "delta": ["rollout.sync_delta=true"],
    "lora": ["model.lora.rank=4", "model.lora.alpha=8", "rollout.lora_sync=adapter"],
}
_REPLAY = {"off": [], "r3": R3}
_MODELS = ("qwen3_moe", "deepseek_v32")
_BASE = ["rollout.engine=sglang", "rollout.sync_mode=colocated", "rollout.num_engines=1"]


def _combos():
    for (f1, f2), replay, family in itertools.product(
        itertools.combinations_with_replacement(sorted(_FEATURES), 2), sorted(_REPLAY), _MODELS
    ):
        yield pytest.param(_FEATURES[f1] + _FEATURES[f2] + _REPLAY[replay], family, id=f"{f1}+{f2}-{replay}-{family}")


@needs_sglang
@pytest.mark.parametrize("overrides,family", list(_combos()))
def test_every_accepted_flag_combination_passes_sglangs_server_args(overrides, family):
    from gspo_megatron.config.validation import _static_errors

    try:
        cfg = load_config(None, _BASE + list(dict.fromkeys(overrides)), check_files=False)
    except ConfigError as err:  # a combination the config refuses (e.g. lora adapter + delta): no engine
        pytest.skip(f"refused by the config validation: {err}")
    hf = tiny_hf_config(family)
    assert _static_errors(cfg, check_files=False) == []
    try:
        _check(cfg, hf)
    except ConfigError as err:  # refused at --check: then sglang must refuse it too
        assert family == "deepseek_v32" and cfg.rollout.engine_tp > 1, err
        assert sglang_cli_errors(launch_args(cfg, hf)), err
        return
    assert startup_errors(cfg, hf) == []
    assert sglang_cli_errors(launch_args(cfg, hf)) == []
