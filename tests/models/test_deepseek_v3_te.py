"""DeepSeek-V3 (multi-latent attention) on Transformer Engine's layer spec, on CPU as far as the mapping
and the shapes go. The model is megatron-core 0.16.1's own: its TE layer spec, its TE wrappers
(TELinear "duplicated" down projections, TELayerNormColumnParallelLinear with the q / kv norms fused,
TEGroupedMLP experts) over a stand-in for TE's base classes (``te_standin.py``: TE's parameter names
and per-rank splits, no forward). Checked in 1 rank, tp2 and ep2: every parameter and
mapped buffer the TE model has is covered by exactly one rule of the TE mapping, with the shape that
rule gives this rank; every HF tensor comes back from exactly one Megatron tensor; HF -> Megatron (TE
names) -> HF is bitwise; the duplicated down projections hold the whole HF tensor on every TP rank
and count once in the grad norm; ``q_a_proj`` + ``kv_a_proj_with_mqa`` leave in one bucket. The
forward on TE (log-probs against transformers) is tests/gpu/test_deepseek_v3_te_gpu.py."""

from __future__ import annotations

import re

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.models import get_family
from gspo_megatron.models.carried import carried_names
from tiny_models import tiny_hf_config

FAMILY = get_family({"model_type": "deepseek_v3"})
LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "ep2": {"ep": 2}}
DOWN = re.compile(r"\.self_attention\.linear_(q|kv)_down_proj\.weight$")


def _hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{hf_dir}/model.safetensors")


@pytest.fixture(scope="module")
def te_runs(tmp_path_factory):
    """{layout name: (hf_dir, per-rank results of te_mla_workers.te_layout)} (one spawn per layout)."""
    from te_mla_workers import te_layout
    from tiny_models import write_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("deepseek_v3_te")
    hf_dir, _ = write_tiny_hf_checkpoint(root, "deepseek_v3", seed=3)
    out = {}
    for name, layout in LAYOUTS.items():
        world = layout.get("tp", 1) * layout.get("ep", 1)
        out[name] = (hf_dir, run_ranks(te_layout, world, layout, hf_dir, 1 << 14))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_te_parameter_has_exactly_one_rule_of_its_shape(te_runs, layout):
    hf_dir, ranks = te_runs[layout]
    hf = tiny_hf_config("deepseek_v3")
    full = _hf_tensors(hf_dir)
    te_rules = FAMILY.mapping(hf).for_spec(te=True)
    tp = LAYOUTS[layout].get("tp", 1)
    for rank, res in enumerate(ranks):
        assert res["te"]  # the model reads as TE-built: the weights code picks the TE rules
        for gname, info in res["tensors"].items():
            matches = [r for r in te_rules.rules if r.match(gname) is not None]
            if not info["param"] and not matches:
                continue  # a buffer the mapping leaves alone (rotary caches, token counts)
            assert len(matches) == 1, (gname, [r.megatron for r in matches])
            (rule,) = matches
            size = {"tp": tp, "etp": tp}.get(rule.parallel, 1)
            pos = {"tp": rank % tp, "etp": rank % tp}.get(rule.parallel, 0)  # tp is the innermost group
            local = rule.to_local([full[h] for h in rule.hf_names(rule.match(gname))], pos, size)
            assert tuple(local.shape) == info["shape"], (gname, rule.megatron)
            assert torch.equal(res["values"][gname], local), gname  # what load_hf_weights put there


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_to_megatron_te_to_hf_is_bitwise(te_runs, layout):
    hf_dir, ranks = te_runs[layout]
    hf = tiny_hf_config("deepseek_v3")
    full = _hf_tensors(hf_dir)
    exported = ranks[0]["exported"]
    expected = {n: t for n, t in full.items() if n not in set(carried_names(hf, list(full)))}
    assert sorted(exported) == sorted(expected)
    for name, t in expected.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    # every HF tensor from exactly one Megatron tensor of the model (over all ranks)
    te_rules = FAMILY.mapping(hf).for_spec(te=True)
    sources: dict[str, set[str]] = {}
    for res in ranks:
        for gname in res["tensors"]:
            found = te_rules.find(gname)
            if found is not None and found[0].export:
                for h in found[1]:
                    sources.setdefault(h, set()).add(gname)
    assert sorted(sources) == sorted(expected)
    assert all(len(s) == 1 for s in sources.values()), {h: s for h, s in sources.items() if len(s) > 1}


def test_te_layout_read_off_megatron_core(te_runs):
    """What TE's MLA spec builds per rank (tp2), against the local spec's mapping: the down
    projections whole on every TP rank (and out of the grad norm's TP-parallel count), the q / kv
    norms fused into the up projections, ``input_layernorm`` its own module, ``_extra_state`` in the
    state dict only."""
    hf_dir, ranks = te_runs["tp2"]
    hf = tiny_hf_config("deepseek_v3")
    assert hf["rope_interleave"]
    full = _hf_tensors(hf_dir)
    mapping = FAMILY.mapping(hf)
    te, local = mapping.for_spec(te=True), mapping.for_spec(te=False)
    a = "decoder.layers.1.self_attention"
    for res in ranks:
        t = res["tensors"]
        assert t[f"{a}.linear_q_down_proj.weight"]["shape"] == (32, 64)  # q_lora x hidden, whole
        assert t[f"{a}.linear_kv_down_proj.weight"]["shape"] == (40, 64)  # (kv_lora + rope) x hidden
        assert t[f"{a}.linear_q_up_proj.layer_norm_weight"]["shape"] == (32,)
        assert t[f"{a}.linear_kv_up_proj.layer_norm_weight"]["shape"] == (32,)
        assert t[f"{a}.linear_q_up_proj.weight"]["shape"] == (4 * 24 // 2, 32)  # heads x (nope + rope) / tp
        assert "decoder.layers.1.input_layernorm.weight" in t
        assert not any(n.endswith(("q_layernorm.weight", "kv_layernorm.weight")) for n in t)
        for n, info in t.items():
            if DOWN.search(n):
                assert info["tensor_model_parallel"] is False, n  # te_attention.TEMLASelfAttention
                assert torch.equal(res["values"][n], full[te.find(n)[1][0]]), n  # rope_interleave: rows as stored
        assert t[f"{a}.linear_q_up_proj.weight"]["tensor_model_parallel"] is True
        assert res["extra_state"] and all(k not in t for k in res["extra_state"])
        assert f"{a}.linear_q_down_proj._extra_state" in res["extra_state"]
    assert te.find(f"{a}.linear_q_down_proj.weight")[0].parallel is None
    assert local.find(f"{a}.linear_q_down_proj.weight")[0].parallel == "tp"
    assert te.find(f"{a}.linear_kv_down_proj.weight")[0].parallel is None
    assert local.find(f"{a}.linear_kv_down_proj.weight")[0].parallel == "tp"


def test_fused_down_projections_leave_in_one_bucket(te_runs):
    """sglang fuses q_a_proj + kv_a_proj_with_mqa only from one load_weights call (rules.mla_fuse_groups):
    the TE model's export (both parts owned by TP rank 0) keeps each layer's pair in one bucket."""
    _, ranks = te_runs["tp2"]
    buckets = ranks[0]["buckets"]
    assert len(buckets) > 4  # small buckets: the grouping is what keeps the pairs together
    for layer in range(4):
        q, kv = (f"model.layers.{layer}.self_attn.{p}.weight" for p in ("q_a_proj", "kv_a_proj_with_mqa"))
        (where,) = [i for i, b in enumerate(buckets) if q in b]
        assert kv in buckets[where], layer


def test_mapping_keeps_the_rules_of_one_spec():
    hf = tiny_hf_config("deepseek_v3")
    mapping = FAMILY.mapping(hf)
    name = "decoder.layers.2.self_attention.linear_kv_down_proj.weight"
    assert [r.spec for r in mapping.rules if r.match(name)] == ["local", "te"]
    assert mapping.find(name)[0].spec == "local"  # unnarrowed (LoRA: local spec only): the local rule
    for te in (False, True):
        assert [r.spec for r in mapping.for_spec(te).rules if r.match(name)] == ["te" if te else "local"]
    assert mapping.for_spec(True).fuse_groups == mapping.fuse_groups


def test_transformer_engine_spec_builds_for_v3():
    FAMILY.check_transformer_impl(te=True)  # DeepSeek-V3.2 / GLM-5 on TE: tests/models/test_dsa_te.py
