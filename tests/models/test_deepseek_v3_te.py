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

import pytest
import torch

from gspo_megatron.models import get_family
from te_mla_workers import DOWN, LAYOUTS, check_round_trip, check_te_rules, te_layout_runs
from tiny_models import tiny_hf_config

FAMILY = get_family({"model_type": "deepseek_v3"})


def _hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(f"{hf_dir}/model.safetensors")


@pytest.fixture(scope="module")
def te_runs(tmp_path_factory):
    """{layout name: (hf_dir, per-rank results of te_mla_workers.te_layout)} (one spawn per layout)."""
    from tiny_models import write_tiny_hf_checkpoint

    hf_dir, _ = write_tiny_hf_checkpoint(tmp_path_factory.mktemp("deepseek_v3_te"), "deepseek_v3", seed=3)
    return {name: (hf_dir, ranks) for name, ranks in te_layout_runs(hf_dir).items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_te_parameter_has_exactly_one_rule_of_its_shape(te_runs, layout):
    hf_dir, ranks = te_runs[layout]
    te_rules = FAMILY.mapping(tiny_hf_config("deepseek_v3")).for_spec(te=True)
    check_te_rules(ranks, te_rules, _hf_tensors(hf_dir), LAYOUTS[layout].get("tp", 1))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_to_megatron_te_to_hf_is_bitwise(te_runs, layout):
    hf_dir, ranks = te_runs[layout]
    hf = tiny_hf_config("deepseek_v3")
    check_round_trip(ranks, FAMILY.mapping(hf).for_spec(te=True), _hf_tensors(hf_dir), hf)


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
