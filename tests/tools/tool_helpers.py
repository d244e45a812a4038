"""Helpers for the CLI tests: run a tool (plain python or torchrun), import a tool as a module,
and write a tiny tokenizer next to a tiny model."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from subprocess_utils import run_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "tools")


def run_tool(name: str, args: list[str], nproc: int = 1, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run tools/<name>.py (under torchrun when nproc > 1); returns the completed process."""
    script = os.path.join(TOOLS, f"{name}.py")
    if nproc > 1:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", script, *args]
    else:
        cmd = [sys.executable, script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return run_group(cmd, timeout=timeout, env=env, cwd=ROOT)  # a timeout kills torchrun's ranks too


def load_tool(name: str):
    """tools/<name>.py as a module (its main(argv) runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_tiny_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A word-level tokenizer: "t5 t7" -> [5, 7]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(out_dir)
