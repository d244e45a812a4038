"""The speculative flags a config asks the engines for (``features/speculative.py`` through
``fleet/engine_args.py``), checked against sglang 0.5.23's own argument parser and its ``/server_info``
fields, against the CPU stand-in's parser (which resolves them as sglang does), and the refusal of an
attached engine that lacks one."""

from __future__ import annotations

import os

import pytest

from gspo_megatron.config.loader import load_config
from gspo_megatron.engines.sglang_engine import server_args_to_cli
from gspo_megatron.fleet.engine_args import _CHECKS, attached_engine_errors, config_server_args
from tiny_models import tiny_hf_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEMO = os.path.join(REPO, "configs/demo_cpu.yaml")
SPEC = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=colocated",
    "rollout.num_engines=1",
    "rollout.speculative=true",
]


def _cfg(*extra):
    return load_config(DEMO, [*SPEC, *extra], check_files=False), tiny_hf_config("glm4_moe", num_nextn_predict_layers=1)


def _sglang_info(cli: list[str]) -> dict:
    server_args = pytest.importorskip("sglang.srt.server_args")
    return server_args.prepare_server_args(["--model-path", "/nonexistent", "--tp-size", "2", *cli]).resolved_dict()


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_flags(steps):
    cfg, hf = _cfg(f"rollout.speculative_steps={steps}")
    args = config_server_args(cfg, hf)
    assert args["speculative_algorithm"] == "EAGLE"
    assert (args["speculative_num_steps"], args["speculative_eagle_topk"]) == (steps, 1)
    assert args["speculative_num_draft_tokens"] == steps + 1
    assert "speculative_draft_model_path" not in args  # sglang defaults it to --model-path for MTP
    assert set(args) <= set(_CHECKS)
    cli = server_args_to_cli(args)
    assert cli[cli.index("--speculative-algorithm") + 1] == "EAGLE"


def test_flags_parse_in_sglang_and_the_cpu_server_alike():
    from gspo_megatron.cpu_server.args import parse_args

    cfg, hf = _cfg("rollout.speculative_steps=2", "rollout.routing_replay=r3")
    cli = server_args_to_cli(config_server_args(cfg, hf))
    assert attached_engine_errors(cfg, hf, "http://e0", _sglang_info(cli)) == []
    cpu = vars(parse_args(["--model-path", "/nonexistent", "--tp-size", "2", *cli]))
    assert attached_engine_errors(cfg, hf, "http://e0", cpu) == []
    assert (cpu["speculative_num_draft_tokens"], cpu["speculative_draft_model_path"]) == (3, "/nonexistent")


def test_an_engine_resolved_from_nextn_satisfies_the_check():
    """sglang resolves NEXTN to EAGLE (and topk 1's draft tokens to steps + 1): the CPU server does too, so
    an engine a user started with --speculative-algorithm NEXTN passes."""
    from gspo_megatron.cpu_server.args import parse_args

    cfg, hf = _cfg("rollout.speculative_steps=3")
    cpu = vars(parse_args(["--model-path", "/m", "--speculative-algorithm", "NEXTN"]))  # auto (3, 1, 4)
    assert attached_engine_errors(cfg, hf, "http://e0", cpu) == []


@pytest.mark.parametrize(
    "info, flag, field",
    [
        ({}, "--speculative-algorithm EAGLE", "rollout.speculative"),
        (
            {"speculative_num_steps": 5, "speculative_num_draft_tokens": 6},
            "--speculative-num-steps 3",
            "rollout.speculative_steps",
        ),
        ({"speculative_eagle_topk": 4}, "--speculative-eagle-topk 1", "rollout.speculative"),
    ],
)
def test_an_engine_without_the_flags_is_named_with_the_field(info, flag, field):
    cfg, hf = _cfg("rollout.speculative_steps=3")
    good = {k: v for k, v in config_server_args(cfg, hf).items()}
    if not info:
        have = {k: v for k, v in good.items() if not k.startswith("speculative_")}
    else:
        have = {**good, **info}
    errors = attached_engine_errors(cfg, hf, "http://e0", have)
    assert any(flag in e and field in e and "http://e0" in e for e in errors), errors
    assert all("\n" not in e for e in errors)


def test_no_flags_without_speculation():
    cfg = load_config(DEMO, [*SPEC[:-1], "model.mtp=true"], check_files=False)
    assert not any(k.startswith("speculative") for k in config_server_args(cfg, tiny_hf_config("glm4_moe")))
