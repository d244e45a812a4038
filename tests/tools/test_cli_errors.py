"""Bad input to the tools: exit status 2 and ONE line on stderr naming the problem, before any
heavy work (these run the tools' main() in-process; one runs the real script for the exit code)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from gspo_megatron.runtime.ports import free_port
from tool_helpers import load_tool, run_tool


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_moe", num_hidden_layers=2)[0]


def fails(capsys, tool: str, argv: list[str], *expected: str) -> str:
    with pytest.raises(SystemExit) as exc:
        load_tool(tool).main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"{tool}: error: ")
    for e in expected:
        assert e in err, err
    return err


def test_missing_hf_dir(capsys, tmp_path):
    fails(
        capsys,
        "hf_to_megatron",
        ["--hf-dir", str(tmp_path / "nope"), "--output", str(tmp_path / "o")],
        "nope",
        "does not exist",
    )


def test_corrupt_safetensors(capsys, tmp_path, hf_dir):
    bad = tmp_path / "hf"
    shutil.copytree(hf_dir, bad)
    with open(bad / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 64)  # garbage header
    fails(
        capsys,
        "hf_to_megatron",
        ["--hf-dir", str(bad), "--output", str(tmp_path / "o")],
        "corrupt safetensors file",
        "model.safetensors",
    )


def test_unsupported_architecture(capsys, tmp_path, hf_dir):
    bad = tmp_path / "hf"
    shutil.copytree(hf_dir, bad)
    cfg = json.load(open(bad / "config.json"))
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    json.dump(cfg, open(bad / "config.json", "w"))
    fails(
        capsys,
        "hf_to_megatron",
        ["--hf-dir", str(bad), "--output", str(tmp_path / "o")],
        "unsupported architecture",
        "GPT2LMHeadModel",
    )


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--tp", "3"], "--tp=3 must divide num_attention_heads"),
        (["--ep", "3"], "--ep=3 must divide the number of experts"),
        (["--pp", "3"], "--pp=3 must divide num_hidden_layers"),
        (["--tp", "2"], "--tp * --pp * --cp = 2 * 1 * 1 = 2 must divide the world size 1"),
    ],
)
def test_indivisible_layout(capsys, tmp_path, hf_dir, args, expected):
    fails(capsys, "hf_to_megatron", ["--hf-dir", hf_dir, "--output", str(tmp_path / "o"), *args], expected)
    assert not os.path.exists(tmp_path / "o")


def test_missing_and_incomplete_checkpoint(capsys, tmp_path):
    fails(
        capsys,
        "megatron_to_hf",
        ["--checkpoint", str(tmp_path / "none"), "--output", str(tmp_path / "o")],
        "does not exist",
    )
    incomplete = tmp_path / "ck"
    incomplete.mkdir()
    (incomplete / "gspo_checkpoint.json").write_text("{}")
    fails(
        capsys,
        "megatron_to_hf",
        ["--checkpoint", str(incomplete), "--output", str(tmp_path / "o")],
        "incomplete",
        "COMPLETE",
    )
    fails(
        capsys, "megatron_to_hf", ["--checkpoint", str(tmp_path), "--output", str(tmp_path / "o")], "no checkpoint in"
    )


def test_bad_shard_size(capsys, tmp_path):
    fails(
        capsys,
        "megatron_to_hf",
        ["--checkpoint", str(tmp_path), "--output", str(tmp_path / "o"), "--max-shard-size", "lots"],
        "--max-shard-size",
    )


@pytest.mark.parametrize(
    "line,expected",
    [
        ('{"input_ids": [1, 2', "invalid JSON"),
        ('{"tokens": [1, 2]}', "'input_ids'"),
        ('{"input_ids": [1, "a"]}', "input_ids[1] = 'a' is not an integer"),
        ('{"input_ids": [1, 2.5]}', "input_ids[1] = 2.5 is not an integer"),
        ('{"input_ids": [1, 256]}', "input_ids[1] = 256 is outside the vocabulary [0, 256)"),
        ('{"input_ids": []}', "non-empty"),
    ],
)
def test_bad_score_rows_name_file_and_line(capsys, tmp_path, hf_dir, line, expected):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"input_ids": [1, 2, 3]}\n' + line + "\n")
    fails(
        capsys,
        "score",
        ["--checkpoint", hf_dir, "--input", str(inp), "--output", str(tmp_path / "o.jsonl")],
        f"{inp}:2:",
        expected,
    )


def test_score_context_parallel_needs_gpu(capsys, tmp_path, hf_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU message is checked on CPU machines")
    fails(
        capsys,
        "score",
        ["--checkpoint", hf_dir, "--input", str(tmp_path / "i"), "--output", str(tmp_path / "o"), "--cp", "2"],
        "--cp > 1 needs Transformer Engine",
    )


def test_real_exit_status_and_single_line(tmp_path):
    res = run_tool("hf_to_megatron", ["--hf-dir", str(tmp_path / "missing"), "--output", str(tmp_path / "o")])
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        f"hf_to_megatron: error: HF directory {tmp_path / 'missing'} does not exist"
    ]


def test_bad_input_under_torchrun_is_printed_once(tmp_path):
    """Every rank finds the mistake; rank 0 prints it once, every rank exits with 2 (torchrun adds its
    own failure report and exits 1)."""
    import subprocess
    import sys

    port = free_port()
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            f"--master-port={port}",
            os.path.join(repo, "tools", "score.py"),
            "--checkpoint",
            str(tmp_path / "nope"),
            "--input",
            "x",
            "--output",
            "y",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    lines = [ln for ln in proc.stderr.splitlines() if "score: error:" in ln]
    assert lines == [f"score: error: --checkpoint {tmp_path / 'nope'} does not exist"], proc.stderr[-3000:]
    assert proc.returncode == 1 and "exitcode  : 2" in proc.stderr and "exitcode  : 1 " not in proc.stderr


@pytest.mark.parametrize(
    "budget,expected",
    [
        ("-1", "--max-tokens-per-micro-batch must be >= 0"),
        ("4", "--max-tokens-per-micro-batch=4 is below the longest row of"),
    ],
)
def test_score_packing_budget(capsys, tmp_path, hf_dir, budget, expected):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2, 3, 4, 5, 6]}\n')
    fails(
        capsys,
        "score",
        [
            "--checkpoint",
            hf_dir,
            "--input",
            str(inp),
            "--output",
            str(tmp_path / "o.jsonl"),
            "--max-tokens-per-micro-batch",
            budget,
        ],
        expected,
    )
