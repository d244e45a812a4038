"""The SGLang flags a config needs (``gspo_megatron/fleet/engine_args.py``), checked against sglang
0.5.23's own argument parser and its ``/server_info`` report (``ServerArgs.resolved_dict``, what
``build_server_info`` returns), and against the CPU stand-in's parser; the command line the launch
scripts call; the refusal of an attached engine that lacks a flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gspo_megatron.config.loader import load_config
from gspo_megatron.engines.sglang_engine import server_args_to_cli
from gspo_megatron.fleet.engine_args import attached_engine_errors, config_server_args, config_server_env
from tiny_models import tiny_hf_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEMO = os.path.join(REPO, "configs/demo_cpu.yaml")
SGLANG = ["rollout.engine=sglang", "rollout.engine_server=cpu", "rollout.sync_mode=colocated", "rollout.num_engines=1"]

CASES = {
    "r3_dsa": (["rollout.routing_replay=r3"], "deepseek_v32"),
    "lora_adapter": (
        ["model.lora.rank=4", "model.lora.alpha=8", "rollout.lora_sync=adapter", "rollout.engine_deterministic=true"],
        "qwen3_moe",
    ),
    "delta_ep": (["rollout.sync_delta=true", "rollout.engine_tp=2", "rollout.engine_ep=2"], "qwen3_moe"),
}


def _case(name):
    overrides, family = CASES[name]
    cfg = load_config(DEMO, [*SGLANG, *overrides], check_files=False)
    return cfg, tiny_hf_config(family)


def _sglang_info(cli: list[str]) -> dict:
    """What a real sglang 0.5.23 engine started with ``cli`` reports on /server_info (its own parser
    and resolution; no model is loaded)."""
    server_args = pytest.importorskip("sglang.srt.server_args")
    return server_args.prepare_server_args(["--model-path", "/nonexistent", "--tp-size", "2", *cli]).resolved_dict()


@pytest.mark.parametrize("case", sorted(CASES))
def test_flags_parse_in_sglang_and_satisfy_the_check(case):
    cfg, hf = _case(case)
    args = config_server_args(cfg, hf)
    info = _sglang_info(server_args_to_cli(args))
    assert attached_engine_errors(cfg, hf, "http://e0", info) == []
    # the CPU stand-in parses the same flags into the same fields
    from gspo_megatron.cpu_server.args import parse_args

    cpu = vars(parse_args(["--model-path", "/nonexistent", "--tp-size", "2", *server_args_to_cli(args)]))
    assert attached_engine_errors(cfg, hf, "http://e0", cpu) == []


def test_each_config_feature_asks_for_its_flag():
    cfg, hf = _case("r3_dsa")
    args = config_server_args(cfg, hf)
    assert args["enable_return_routed_experts"] and args["enable_return_indexer_topk"]
    assert config_server_env(args) == {"SGLANG_DSA_FUSE_TOPK": "0"}
    cfg, hf = _case("lora_adapter")
    args = config_server_args(cfg, hf)
    assert args["enable_lora"] and args["max_lora_rank"] == 4 and args["enable_deterministic_inference"]
    assert "q_proj" in args["lora_target_modules"]
    cfg, hf = _case("delta_ep")
    args = config_server_args(cfg, hf)
    assert args["ep_size"] == 2 and args["custom_weight_loader"] == [
        "gspo_megatron.weight_sync.delta_loader.apply_deltas"
    ]
    plain = config_server_args(load_config(DEMO, SGLANG, check_files=False), tiny_hf_config("qwen3_moe"))
    assert plain == {"random_seed": 1234}


@pytest.mark.parametrize(
    "case,dropped,field",
    [
        ("r3_dsa", "--enable-return-routed-experts", "rollout.routing_replay=r3"),
        ("r3_dsa", "--enable-return-indexer-topk", "rollout.routing_replay=r3 (a DSA model"),
        ("lora_adapter", "--enable-lora", "rollout.lora_sync=adapter"),
        ("lora_adapter", "--enable-deterministic-inference", "rollout.engine_deterministic"),
        ("delta_ep", "--ep-size", "rollout.engine_ep"),
        ("delta_ep", "--custom-weight-loader", "rollout.sync_delta"),
    ],
)
def test_an_engine_without_a_flag_is_named_with_the_field(case, dropped, field):
    cfg, hf = _case(case)
    cli = server_args_to_cli(config_server_args(cfg, hf))
    i = cli.index(dropped)
    j = i + 1
    while j < len(cli) and not cli[j].startswith("--"):
        j += 1
    errors = attached_engine_errors(cfg, hf, "http://e0", _sglang_info(cli[:i] + cli[j:]))
    assert len(errors) == 1, errors
    assert "http://e0" in errors[0] and dropped in errors[0] and field in errors[0]


def test_lora_capacity_may_be_larger_and_all_targets_cover_every_module():
    cfg, hf = _case("lora_adapter")
    cli = ["--enable-lora", "--max-lora-rank", "64", "--lora-target-modules", "all", "--enable-deterministic-inference"]
    assert attached_engine_errors(cfg, hf, "http://e0", _sglang_info(cli)) == []
    small = [
        "--enable-lora",
        "--max-lora-rank",
        "2",
        "--lora-target-modules",
        "all",
        "--enable-deterministic-inference",
    ]
    (err,) = attached_engine_errors(cfg, hf, "http://e0", _sglang_info(small))
    assert "max_lora_rank=2" in err and "--max-lora-rank 4" in err


def test_every_flag_the_config_can_ask_for_has_a_check_row():
    from gspo_megatron.fleet.engine_args import _CHECKS

    asked = set()
    for name in CASES:
        asked |= set(config_server_args(*_case(name)))
    assert asked - set(_CHECKS) == set()


def test_a_given_route_spec_decides_the_indexer_flag_instead_of_the_config_json():
    from dataclasses import replace

    from gspo_megatron.engines.routing import route_spec_of

    cfg, dsa = _case("r3_dsa")
    moe = tiny_hf_config("qwen3_moe")
    assert "enable_return_indexer_topk" not in config_server_args(cfg, moe)
    spec = route_spec_of(dsa)
    assert config_server_args(cfg, moe, spec)["enable_return_indexer_topk"]
    assert "enable_return_indexer_topk" not in config_server_args(cfg, dsa, replace(spec, index_topk=0))
    info = {"enable_return_routed_experts": True}  # no indexer flag: refused only with the DSA spec
    assert attached_engine_errors(cfg, moe, "http://e0", info) == []
    (err,) = attached_engine_errors(cfg, moe, "http://e0", info, route_spec=spec)
    assert "--enable-return-indexer-topk" in err


def _cli(*argv):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "gspo_megatron.fleet.engine_args", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_command_line_prints_the_flags_and_refuses_a_bad_config(tmp_path):
    out = _cli(DEMO, *SGLANG, "rollout.routing_replay=r3", "rollout.engine_tp=2", "rollout.engine_ep=2")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--random-seed", "1234", "--ep-size", "2", "--enable-return-routed-experts"]
    bad = _cli(DEMO, "rollout.routing_replay=r3")  # the in-process engine returns no routes
    assert bad.returncode == 2 and bad.stdout == ""
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith("engine_args: error:") and "rollout.routing_replay=r3" in line
