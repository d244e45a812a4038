"""tools/plan.py exit codes and messages, and docs/planner.md kept in sync with the planner."""

import io
import re
import shlex
import subprocess
import sys

import pytest

from gspo_megatron.plan_report import build_arg_parser, plan_main, run_plan


def plan_cli(*args):
    p = subprocess.run([sys.executable, "tools/plan.py", *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_cli_recipe_that_fits_exits_0():
    rc, out = plan_cli(
        "--config", "configs/qwen3_30b_a3b_gspo.yaml", "--nodes", "2", "--gpus-per-node", "8", "--gpu-memory-gb", "80"
    )
    assert rc == 0, out
    assert "TP 2  PP 1  CP 1  EP 8  ETP 1  DP 8  expert-DP 2" in out
    assert "experts per rank 16 (of 128)" in out and "headroom" in out


@pytest.mark.parametrize(
    "args, rc, expected",
    [
        (
            ["--config", "configs/qwen3_235b_a22b_gspo.yaml", "--nodes", "2"],
            2,
            "parallel.ep * parallel.etp * parallel.pp = 32 * 1 * 2 = 64 must divide the world size 16",
        ),
        (
            ["--config", "configs/qwen3_30b_a3b_gspo.yaml", "--nodes", "2", "parallel.tp=8"],
            2,
            "parallel.tp=8 must divide num_key_value_heads = 4",
        ),
        (
            ["--config", "configs/qwen3_30b_a3b_gspo.yaml", "--nodes", "2", "parallel.tpp=2"],
            2,
            "unknown key 'parallel.tpp'; did you mean 'parallel.tp'?",
        ),
        (
            ["--config", "configs/qwen3_235b_a22b_gspo.yaml", "--nodes", "8", "--gpu-memory-gb", "40"],
            1,
            "-> DOES NOT FIT",
        ),
        (
            ["--config", "configs/qwen3_235b_a22b_gspo.yaml", "--nodes", "8", "rollout.offload_train=false"],
            1,
            "does not fit: no room for the KV cache: raise rollout.engine_mem_fraction or rollout.engine_tp, or set "
            "rollout.offload_train=true",
        ),
        (
            [
                "--config",
                "configs/qwen3_235b_a22b_gspo.yaml",
                "--nodes",
                "8",
                "--gpu-memory-gb",
                "60",
                "optimizer.cpu_offload_fraction=0",
                "rollout.engine_mem_fraction=0.9",
            ],
            1,
            "optimizer.cpu_offload_fraction",
        ),
        (["--nodes", "0"], 2, "--nodes must be > 0"),
    ],
)
def test_exit_codes(args, rc, expected):
    buf = io.StringIO()
    a = build_arg_parser().parse_args(args)
    assert run_plan(a.config, a.overrides, a.nodes, a.gpus_per_node, a.gpu_memory_gb, out=buf) == rc
    assert expected in buf.getvalue(), buf.getvalue()


def test_cli_subprocess_exit_codes():
    assert plan_cli("--config", "configs/qwen3_235b_a22b_gspo.yaml", "--nodes", "2")[0] == 2
    assert plan_cli("--config", "configs/qwen3_235b_a22b_gspo.yaml", "--nodes", "8", "--gpu-memory-gb", "40")[0] == 1
    assert plan_main(["--nodes", "1", "--gpus-per-node", "2"]) == 0  # the CPU demo defaults
    rc, out = plan_cli("--help")
    assert rc == 0 and "--gpus-per-node" in out


def test_docs_show_the_current_planner_output():
    doc = open("docs/planner.md").read()
    blocks = re.findall(r"```\n\$ (python tools/plan\.py [^\n]*)\n(.*?)\[exit (\d)\]\n```", doc, re.S)
    assert len(blocks) >= 4
    shapes = set()
    for cmd, printed, rc in blocks:
        a = build_arg_parser().parse_args(shlex.split(cmd)[2:])
        buf = io.StringIO()
        assert run_plan(a.config, a.overrides, a.nodes, a.gpus_per_node, a.gpu_memory_gb, out=buf) == int(rc)
        assert buf.getvalue() == printed, cmd
        shapes.add((a.config, a.nodes, a.gpus_per_node, a.gpu_memory_gb))
    for cfg in ("configs/qwen3_30b_a3b_gspo.yaml", "configs/qwen3_235b_a22b_gspo.yaml"):
        assert (cfg, 8, 8, 80.0) in shapes
    assert ("configs/qwen3_30b_a3b_gspo.yaml", 2, 8, 80.0) in shapes


def test_every_recipe_fits_the_shape_named_in_its_comment():
    import glob

    for path in glob.glob("configs/*.yaml"):
        m = re.search(r"--nodes (\d+) --gpus-per-node (\d+) --gpu-memory-gb (\d+)", open(path).read())
        if m is None:
            continue  # the CPU demo names no cluster
        buf = io.StringIO()
        assert run_plan(path, [], int(m[1]), int(m[2]), float(m[3]), out=buf) == 0, (path, buf.getvalue())
