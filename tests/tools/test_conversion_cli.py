"""The command-line tools end to end, as users run them (subprocesses, torchrun for 2 ranks):
hf_to_megatron (1 process) -> megatron_to_hf (TP2, small --max-shard-size: sharded output with an
index) -> transformers.from_pretrained gives the original logits; the tokenizer and generation
config travel along; tools/score.py (1 process on the HF dir, 2 ranks with EP2 on the Megatron
checkpoint) matches transformers' log-probs in input order."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tool_helpers import run_tool, save_tiny_tokenizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from hf_reference import hf_logprobs, make_rows, max_abs_diff

MAX_SHARD = 300_000


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("cli")
    hf_dir, ckpt, out = str(root / "hf"), str(root / "ckpt"), str(root / "out")
    model = save_tiny_hf_model("qwen3_moe", hf_dir, seed=4)
    save_tiny_tokenizer(hf_dir, 256)
    to_mcore = run_tool("hf_to_megatron", ["--hf-dir", hf_dir, "--output", ckpt])
    assert to_mcore.returncode == 0, to_mcore.stderr[-3000:]
    to_hf = run_tool(
        "megatron_to_hf",
        ["--checkpoint", ckpt, "--output", out, "--tp", "2", "--max-shard-size", str(MAX_SHARD)],
        nproc=2,
    )
    assert to_hf.returncode == 0, to_hf.stderr[-3000:]
    return dict(model=model, hf_dir=hf_dir, ckpt=ckpt, out=out, root=root, stdout=to_hf.stdout)


def test_sharded_output_with_index(converted):
    out = converted["out"]
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 1 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    from safetensors import safe_open

    total = 0
    for name in files:
        with safe_open(os.path.join(out, name), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            keys = list(f.keys())
            sizes = [f.get_tensor(k).numel() * 4 for k in keys]
        assert sum(sizes) <= MAX_SHARD or len(keys) == 1
        assert all(index["weight_map"][k] == name for k in keys)
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total


def test_output_loads_in_transformers_with_same_logits(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    reloaded = AutoModelForCausalLM.from_pretrained(converted["out"]).eval()
    original = converted["model"].eval()
    ids = torch.tensor([make_rows(seed=1, n=3)[2]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, original(ids).logits)
    tok = AutoTokenizer.from_pretrained(converted["out"])
    assert tok("t5 t7 t200")["input_ids"] == [5, 7, 200]
    assert (
        GenerationConfig.from_pretrained(converted["out"]).to_dict()
        == GenerationConfig.from_pretrained(converted["hf_dir"]).to_dict()
    )


def _write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps({"input_ids": r}) + "\n")


def _read_logprobs(path):
    return [json.loads(line)["logprobs"] for line in open(path)]


@pytest.mark.parametrize(
    "source,nproc,layout",
    [
        ("hf_dir", 1, []),
        ("ckpt", 2, ["--ep", "2"]),
        # sequence packing: whole rows in micro-batches of at most 64 tokens, balanced over 2 replicas
        ("ckpt", 2, ["--ep", "2", "--max-tokens-per-micro-batch", "64"]),
    ],
    ids=["hf_dir", "ckpt-ep2", "ckpt-ep2-packed"],
)
def test_score_cli_matches_transformers(converted, source, nproc, layout):
    rows = make_rows(seed=9, n=9)
    tag = f"{source}{len(layout)}"
    inp, outp = converted["root"] / f"in_{tag}.jsonl", converted["root"] / f"out_{tag}.jsonl"
    _write_rows(inp, rows)
    res = run_tool(
        "score",
        [
            "--checkpoint",
            converted[source],
            "--input",
            str(inp),
            "--output",
            str(outp),
            "--micro-batch-size",
            "2",
            *layout,
        ],
        nproc=nproc,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    got = _read_logprobs(outp)
    assert max_abs_diff(got, hf_logprobs(converted["model"], rows)) < 1e-4
