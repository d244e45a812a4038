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


def _model_dir(tmp_path, family: str) -> str:
    from gspo_megatron.models.tiny import save_tiny_hf_model

    path = str(tmp_path / family)
    save_tiny_hf_model(family, path, with_mtp=True)
    return path


def test_flags_parse_in_sglang_and_the_cpu_server_alike(tmp_path):
    from gspo_megatron.cpu_server.args import parse_args

    cfg, hf = _cfg("rollout.speculative_steps=2", "rollout.routing_replay=r3")
    cli = server_args_to_cli(config_server_args(cfg, hf))
    assert attached_engine_errors(cfg, hf, "http://e0", _sglang_info(cli)) == []
    glm = _model_dir(tmp_path, "glm4_moe")
    cpu = vars(parse_args(["--model-path", glm, "--tp-size", "2", *cli]))
    assert attached_engine_errors(cfg, hf, "http://e0", cpu) == []
    assert (cpu["speculative_num_draft_tokens"], cpu["speculative_draft_model_path"]) == (3, glm)
    assert cpu["max_running_requests"] == 16 * 8  # the demo's step: 16 prompts x 8 samples, sent at once


def test_draft_path_defaults_to_the_model_only_where_sglang_does(tmp_path):
    """``_handle_eagle_family`` defaults ``--speculative-draft-model-path`` to ``--model-path`` for the
    DeepSeek / GLM architectures only; a Qwen3-Next engine reports none (its draft worker reads the model
    path), and an unreadable model directory decides nothing."""
    from gspo_megatron.cpu_server.args import parse_args

    spec = ["--speculative-algorithm", "EAGLE"]
    for family, want in (("glm4_moe", "model"), ("qwen3_next", None)):
        path = _model_dir(tmp_path, family)
        got = parse_args(["--model-path", path, *spec]).speculative_draft_model_path
        assert got == (path if want else None), family
    assert parse_args(["--model-path", "/nonexistent", *spec]).speculative_draft_model_path is None


def test_max_running_requests_as_sglang_resolves_it():
    """sglang 0.5.23 sets 48 on a speculative engine given none (``_handle_eagle_family``) and honours a
    given value: the CPU server resolves the flag alike (None without speculation: its KV-cache estimate)."""
    from gspo_megatron.cpu_server.args import parse_args

    sglang_info = _sglang_info(["--speculative-algorithm", "EAGLE"]).get("max_running_requests")
    cpu = parse_args(["--model-path", "/m", "--speculative-algorithm", "EAGLE"]).max_running_requests
    assert cpu == 48
    assert sglang_info in (None, 48)  # unresolved without the model's config (no such directory here)
    assert parse_args(["--model-path", "/m"]).max_running_requests is None
    given = ["--model-path", "/m", "--speculative-algorithm", "EAGLE", "--max-running-requests", "300"]
    assert parse_args(given).max_running_requests == 300


@pytest.mark.parametrize(
    "extra, want",
    [
        ([], 128),  # 16 prompts x 8
        (["rollout.engine_max_running_requests=48"], 48),  # sglang's speculative default, asked for
        (
            ["rollout.prompts_per_step=2", "rollout.group_size=4", "parallel.micro_batch_size=4"],
            48,
        ),  # never below sglang's own 48
        (["rollout.dynamic_sampling=true", "rollout.over_sample=1.5"], 24 * 8),  # ceil(1.5 x 16) prompts at once
        (
            [
                "rollout.sync_mode=disaggregated",
                "rollout.max_staleness=1",
                "rollout.inflight_updates=in_place",
                "rollout.inflight_groups=40",
                "rollout.dynamic_sampling=false",
            ],
            40 * 8,
        ),
    ],
)
def test_a_speculative_engine_runs_the_rollout_at_once(extra, want):
    cfg, hf = _cfg(*extra)
    args = config_server_args(cfg, hf)
    assert args["max_running_requests"] == want
    cli = server_args_to_cli(args)
    assert cli[cli.index("--max-running-requests") + 1] == str(want)
    # a tuning flag: an attached engine left at sglang's 48 generates the same samples, in waves
    assert attached_engine_errors(cfg, hf, "http://e0", {**args, "max_running_requests": 48}) == []


def test_max_running_requests_without_speculation():
    plain = [*SPEC[:-1]]
    cfg = load_config(DEMO, plain, check_files=False)
    assert "max_running_requests" not in config_server_args(cfg, None)  # sglang's own limit
    cfg = load_config(DEMO, [*plain, "rollout.engine_max_running_requests=256"], check_files=False)
    assert config_server_args(cfg, None)["max_running_requests"] == 256


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


def test_the_draft_path_rule_is_sglangs():
    """The families whose draft path the CPU server defaults (``sglang_draft_path_defaulted``) are exactly the
    registered architectures of ``_handle_eagle_family``'s list, read from sglang's own source."""
    import inspect
    import re

    from gspo_megatron.cpu_server.speculative import draft_path_defaulted
    from gspo_megatron.models.registry import families

    hook = pytest.importorskip("sglang.srt.arg_groups.speculative_hook")
    source = inspect.getsource(hook._handle_eagle_family)
    listed = set(re.findall(r'"(\w+)"', source.split("if model_arch in [", 1)[1].split("]:", 1)[0]))
    assert "Glm4MoeForCausalLM" in listed and "Qwen3NextForCausalLM" not in listed
    ours = {arch for f in families() for arch in f.architectures}
    assert set(draft_path_defaulted()) == listed & ours
