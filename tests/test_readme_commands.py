"""The commands of README.md's Training section and docs/demo.md run as written (issue 14: every
command in the docs is run by a test).

Each command is run verbatim by bash in a scratch directory that looks like a checkout after
`make demo`: ``configs/`` and ``.venv`` link to the real ones, and ``runs/demo/hf_final`` holds a
Hugging Face model with the demo tokenizer and chat template (a tiny Qwen3-MoE saved by transformers;
the stand-in for the demo's export). COMMANDS says, for every command of those blocks, the exit
status it must end with, or which test runs it instead (the full 450-step demo)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
VENV = os.path.dirname(os.path.dirname(sys.executable))

# command (as written) -> expected exit status, or the test that runs it instead
COMMANDS = {
    ".venv/bin/gspo-train --config configs/demo_cpu.yaml": "tests/train/test_demo.py (450 steps)",
    ".venv/bin/gspo-train --help": 0,
    ".venv/bin/gspo-train --config configs/demo_cpu.yaml --check": 0,
    ".venv/bin/gspo-train --config configs/demo_cpu.yaml parallel.ep=2": 2,
    ".venv/bin/gspo-train --config configs/qwen3_30b_a3b_gspo.yaml --dry-run --nodes 2 --gpus-per-node 8 "
    "--gpu-memory-gb 80": 0,
    ".venv/bin/torchrun --nproc-per-node 2 -m gspo_megatron.train --config configs/demo_cpu.yaml parallel.ep=2 "
    "parallel.micro_batch_size=32 train.steps=5 output_dir=runs/demo_ep2": 0,
}
HF_HEADING = "### From a Hugging Face checkpoint, with your data and reward"


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def commands(block: str) -> list[str]:
    """One command per logical line (continuations joined, trailing comments dropped)."""
    joined = block.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(re.sub(r"\s+", " ", line))
    return out


def training_section() -> str:
    readme = open(os.path.join(REPO, "README.md")).read()
    return readme[readme.index("## Training\n") : readme.index("\n## ", readme.index("## Training\n") + 5)]


def doc_commands() -> list[str]:
    section = training_section()
    hf_block = section[section.index(HF_HEADING) :]
    cmds = [c for b in bash_blocks(section[: section.index(HF_HEADING)]) for c in commands(b)]
    demo = open(os.path.join(REPO, "docs", "demo.md")).read()
    cmds += [c for b in bash_blocks(demo) for c in commands(b)]
    assert bash_blocks(hf_block), "the Hugging Face example is missing"
    return cmds


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A scratch directory shaped like the repository after `make demo`."""
    from gspo_megatron.data.tokenizer import build_demo_tokenizer
    from gspo_megatron.models.tiny import save_tiny_hf_model

    d = tmp_path_factory.mktemp("checkout")
    os.symlink(os.path.join(REPO, "configs"), d / "configs")
    os.symlink(VENV, d / ".venv")
    hf = d / "runs" / "demo" / "hf_final"
    save_tiny_hf_model("qwen3_moe", str(hf), num_hidden_layers=2, vocab_size=320)
    build_demo_tokenizer(str(hf))
    cfg = json.load(open(hf / "config.json"))  # the names the demo's export writes
    cfg.setdefault("num_experts", cfg.get("num_local_experts"))
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    json.dump(cfg, open(hf / "config.json", "w"), indent=2)
    return d


def bash(script: str, cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("PYTHONPATH", REPO)  # CI installs the package; a worktree run puts it on the path
    return subprocess.run(
        ["bash", "-e", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_every_documented_command_is_accounted_for():
    cmds = doc_commands()
    assert sorted(set(cmds)) == sorted(COMMANDS), (
        f"commands in the docs without an entry: {sorted(set(cmds) - set(COMMANDS))}; "
        f"entries no longer in the docs: {sorted(set(COMMANDS) - set(cmds))}"
    )


@pytest.mark.parametrize("cmd", [c for c, v in COMMANDS.items() if isinstance(v, int)])
def test_documented_command_runs_as_written(cmd, checkout):
    proc = bash(cmd, checkout)
    assert proc.returncode == COMMANDS[cmd], (cmd, proc.stdout[-2000:], proc.stderr[-3000:])
    if COMMANDS[cmd] == 2:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("gspo-train: error: ") and "world size 1" in lines[0], lines
    if "--check" in cmd:
        assert "config OK" in proc.stdout
    if "train.steps=5" in cmd:
        rows = open(checkout / "runs" / "demo_ep2" / "metrics.jsonl").read().splitlines()
        assert [json.loads(r)["step"] for r in rows] == [1, 2, 3, 4, 5]


def test_the_hugging_face_example_runs_as_written(checkout):
    section = training_section()
    script = bash_blocks(section[section.index(HF_HEADING) :])[0]
    proc = bash(script, checkout)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    run = checkout / "runs" / "mine"
    rows = [json.loads(r) for r in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert all(r["reward/errors"] == 0 for r in rows)
    assert (run / "hf_final" / "config.json").exists()
    saved = open(run / "config.yaml").read()
    assert saved.startswith(
        "# model: architecture from runs/demo/hf_final/config.json, weights from runs/demo/hf_final"
    ), saved[:300]
    assert "arch: null" in saved and "hf_path: runs/demo/hf_final" in saved
