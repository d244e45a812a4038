"""torchrun --nproc-per-node 2 splits a conversion over the ranks (no layout flags: the tools pick
pipeline stages, or expert parallel) and writes what one process writes: HF -> Megatron on 2 ranks
loads back to the same tensors, and Megatron -> HF on 2 ranks writes byte-identical safetensors
shards and index (several shards, every rank writing into them), equal to the original weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tool_helpers import run_tool

MAX_SHARD = "200KB"


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]


def _files(d):
    return {
        n: open(os.path.join(d, n), "rb").read()
        for n in sorted(os.listdir(d))
        if n.startswith("model") and (".safetensors" in n)
    }


def _weights(d):
    out = {}
    for n in _files(d):
        if n.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, n)))
    return out


@pytest.mark.parametrize("kind,export_args", [("qwen3_moe", []), ("gpt_oss", ["--ep", "2"])])
def test_two_ranks_write_what_one_writes(tmp_path, kind, export_args):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    hf = str(tmp_path / "hf")
    save_tiny_hf_model(kind, hf, seed=5)
    original = load_file(os.path.join(hf, "model.safetensors"))
    ck1, ck2, out1, out2 = (str(tmp_path / n) for n in ("ck1", "ck2", "out1", "out2"))
    _ok(run_tool("hf_to_megatron", ["--hf-dir", hf, "--output", ck1]))
    _ok(run_tool("megatron_to_hf", ["--checkpoint", ck1, "--output", out1, "--max-shard-size", MAX_SHARD]))
    _ok(
        run_tool(
            "megatron_to_hf",
            ["--checkpoint", ck1, "--output", out2, "--max-shard-size", MAX_SHARD, *export_args],
            nproc=2,
        )
    )
    one, two = _files(out1), _files(out2)
    assert len(one) > 2 and "model.safetensors.index.json" in one
    assert one.keys() == two.keys()
    for name in one:
        assert one[name] == two[name], name
    exported = _weights(out1)
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    if kind == "qwen3_moe":  # the other direction on 2 ranks (pipeline stages picked by the tool)
        _ok(run_tool("hf_to_megatron", ["--hf-dir", hf, "--output", ck2], nproc=2))
        with open(os.path.join(ck2, "gspo_checkpoint.json")) as f:
            assert json.load(f)["layout"]["pp"] == 2  # written by 2 pipeline stages
        out3 = str(tmp_path / "out3")
        _ok(run_tool("megatron_to_hf", ["--checkpoint", ck2, "--output", out3, "--max-shard-size", MAX_SHARD]))
        assert _files(out3) == one
