"""``rollout.lora_sync=adapter`` in parallel layouts (weight_sync/lora_adapter.py ``gathered_peft_tensors``):
the adapter tensors gathered to rank 0 in tp2, pp2, ep2 and tp2 x ep2 (etp1) (2 gloo ranks) equal the
single rank's, bitwise, on the tiny Qwen3-MoE with adapters on every linear, routed experts included
(per-expert PEFT names ``...mlp.experts.<e>.{gate,up,down}_proj``); and the single rank's equal
``lora_peft.peft_tensors`` (the PEFT export). On Transformer Engine's layer spec (the TE stand-in:
fused-norm linears, grouped experts with one adapter per expert) one rank, ep2 and tp2 give the local
spec's tensors, bitwise (A seeded by the spec-independent name, B set alike)."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from lora_adapter_gather_workers import gathered_adapters

OVERRIDES = ["model.lora.rank=4", "model.lora.alpha=8"]
LAYOUTS = [dict(tp=2), dict(pp=2), dict(ep=2), dict(tp=2, ep=2, etp=1)]
NAMES = ["tp2", "pp2", "ep2", "ep2+etp1+tp2"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    d = str(tmp_path_factory.mktemp("qwen3_moe") / "hf")
    save_tiny_hf_model("qwen3_moe", d, seed=11)
    return d


@pytest.fixture(scope="module")
def single(hf_dir):
    return run_ranks(gathered_adapters, 1, hf_dir, [dict()], OVERRIDES)[0]["tp1"]


@pytest.fixture(scope="module")
def multi(hf_dir):
    return run_ranks(gathered_adapters, 2, hf_dir, LAYOUTS, OVERRIDES, timeout=900)[0]


def test_single_rank_names(single):
    names = single["tensors"]
    assert any(".mlp.experts.0.gate_proj.lora_A.weight" in n for n in names), sorted(names)[:10]
    assert any(".mlp.experts.3.down_proj.lora_B.weight" in n for n in names), sorted(names)[:10]
    assert any(".self_attn.q_proj.lora_B.weight" in n for n in names)
    assert len(names) == 2 * len(single["modules"])
    assert any(t.abs().sum() > 0 for n, t in names.items() if ".lora_B." in n)  # B set


@pytest.mark.parametrize("name", NAMES)
def test_gathered_equal_single_rank(single, multi, name):
    got = multi[name]
    assert got["modules"] == single["modules"]
    assert sorted(got["tensors"]) == sorted(single["tensors"])
    for k, want in single["tensors"].items():
        assert got["tensors"][k].shape == want.shape and torch.equal(got["tensors"][k], want), (name, k)


@pytest.fixture(scope="module")
def te_runs(hf_dir):
    one = run_ranks(gathered_adapters, 1, hf_dir, [dict()], OVERRIDES, "transformer_engine")[0]
    two = run_ranks(
        gathered_adapters, 2, hf_dir, [dict(ep=2), dict(tp=2)], OVERRIDES, "transformer_engine", timeout=900
    )
    return {**one, **two[0]}


@pytest.mark.parametrize("name", ["tp1", "ep2", "tp2"])
def test_te_spec_gathers_the_local_specs_adapters(single, te_runs, name):
    got = te_runs[name]
    assert got["modules"] == single["modules"]
    assert sorted(got["tensors"]) == sorted(single["tensors"])
    for k, want in single["tensors"].items():
        assert torch.equal(got["tensors"][k], want), (name, k)
