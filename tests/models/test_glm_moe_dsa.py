"""glm_moe_dsa family (GLM-5: DeepSeek-V3.2's architecture with an interleaved-RoPE indexer): what the
shared family tests cannot show.

- The indexer (``InterleavedLightningIndexer``) selects exactly what transformers 5.23's
  ``GlmMoeDsaIndexer`` selects, ties included (one indexer head: many exact-zero ties at the k-th place);
  the rotate-half RoPE of DeepSeek-V3.2 selects otherwise on the same weights (so the RoPE style is real).
- Sequences longer than ``index_topk``: Megatron's log-probs equal transformers' within 1e-4 and the
  selection masks causal keys (dropping it moves them by > 1e-3).
- ``indexer_types`` with ``"shared"`` layers (no indexer; the last full layer's selection reused):
  full, shared, shared, full in 1 rank: equal to transformers, each shared layer attends with the very
  selection of its full layer; dropping the reuse, or giving the shared layers indexers of their own
  (transformers with every layer full), moves the log-probs by > 1e-3; no indexer parameter on either
  side (Megatron, sglang's ``GlmMoeDsaForCausalLM``), and the weight-sync stream (the checkpoint's
  tensors exactly) leaves no sglang parameter unwritten. full, shared, full, shared (index_topk_freq 2):
  TP2 / PP2 / EP2 equal to transformers and HF -> Megatron -> HF bitwise; packed sequences of mixed
  lengths and the same sequences right-padded, in 1 rank, TP2 and EP2, equal to transformers row by row,
  packed and padded GSPO gradients agree; routing replay r3 (the transformers engine's selection, the
  shared layers' slots mirroring their full layer's as sglang's capture does) makes the trainer equal
  the engine. Refused in one line: a shared layer 0, a pipeline stage starting on a shared layer
  (naming parallel.pp), model.recompute.
- The published config's dims.
Layouts TP2 / PP2 / EP2 / TP2 x EP2 and HF -> Megatron -> HF bitwise (all layers full):
tests/models/test_equivalence.py.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import pytest

from distributed_harness import run_ranks
from gspo_megatron.models import get_family
from hf_reference import hf_logprobs, make_rows, max_abs_diff
from tiny_models import tiny_hf_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pipeline"))
from packing_workers import make_records, packed_vs_padded_1_rank_tp2_ep2

FAMILY = get_family({"model_type": "glm_moe_dsa"})
_cfg = partial(tiny_hf_config, "glm_moe_dsa")


@pytest.fixture(scope="module")
def tiny(tiny_hf_checkpoint):
    hf_dir, model = tiny_hf_checkpoint("glm_moe_dsa", seed=11)
    return os.path.dirname(hf_dir), model  # <d>/hf; the tests convert to <d>/ckpt


def test_indexer_selects_what_transformers_selects_ties_included():
    from dsa_workers import indexer_vs_transformers

    cfg = _cfg(index_n_heads=1, index_topk=5)
    ours, rotate_half = (
        run_ranks(indexer_vs_transformers, 1, cfg, 40)[0],
        run_ranks(indexer_vs_transformers, 1, cfg, 40, False)[0],
    )
    assert ours["equal"] and ours["tied_rows"] >= 5, ours
    assert not rotate_half["equal"]  # DeepSeek-V3.2's RoPE style on GLM-5's indexer: another selection


def test_megatron_masks_beyond_topk_and_equals_transformers(tiny):
    from dsa_workers import score_with_and_without_selection

    d, model = tiny
    rows = make_rows(seed=3, n=5)
    ref = hf_logprobs(model.float(), rows)
    (r,) = run_ranks(score_with_and_without_selection, 1, f"{d}/hf", f"{d}/ckpt", rows)
    assert r["masked_pairs"] > 100
    assert max_abs_diff(r["sparse"], ref) < 1e-4
    assert max_abs_diff(r["dense"], ref) > 1e-3


SHARED_FSFS = ["full", "shared", "full", "shared"]
SHARED_FSSF = ["full", "shared", "shared", "full"]


@pytest.fixture(scope="module")
def shared_fsfs(tiny_hf_checkpoint):
    """full, shared, full, shared (transformers' rule: index_topk_freq 2, index_skip_topk_offset 1):
    every pipeline stage of PP2 starts on a full layer."""
    hf_dir, model = tiny_hf_checkpoint("glm_moe_dsa", seed=11, index_topk_freq=2, index_skip_topk_offset=1)
    assert model.config.indexer_types == SHARED_FSFS
    return hf_dir, model


def test_packed_and_padded_mixed_lengths_equal_transformers_in_1_rank_tp2_ep2(shared_fsfs):
    hf_dir, model = shared_fsfs
    rows = [r.tokens for r in make_records()]
    ref = hf_logprobs(model.float(), rows)
    results = packed_vs_padded_1_rank_tp2_ep2(hf_dir, 64)
    for name, per_rank in results.items():
        scored = [e["score"] for e in per_rank if "score" in e]
        assert len(scored) == 1, name
        padded, packed = scored[0]
        assert max_abs_diff(packed, ref) < 1e-4, name
        assert max_abs_diff(padded, ref) < 1e-4, name
        for e in per_rank:
            assert e["finite"] and e["grad_max"] > 1e-4, name
            assert e["grad_diff"] < 1e-5 * max(1.0, e["grad_max"]), (name, e["grad_diff"])


def test_shared_layers_reuse_the_full_layers_selection_as_transformers(tiny_hf_checkpoint):
    import torch
    from safetensors.torch import load_file
    from transformers import GlmMoeDsaForCausalLM

    from dsa_workers import shared_layer_selections

    hf_dir, model = tiny_hf_checkpoint("glm_moe_dsa", seed=11, indexer_types=SHARED_FSSF)
    rows = make_rows(seed=3, n=5)
    ref = hf_logprobs(model.float(), rows)
    # the same weights, each former shared layer running an indexer of its own (random weights)
    own = GlmMoeDsaForCausalLM(model.config.__class__(**{**model.config.to_dict(), "indexer_types": ["full"] * 4}))
    missing = own.load_state_dict(model.state_dict(), strict=False).missing_keys
    assert missing and all(".self_attn.indexer." in k for k in missing)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for k in missing:
            own.get_parameter(k).copy_(torch.randn(own.get_parameter(k).shape, generator=g) * 0.3)
    ref_own = hf_logprobs(own.float(), rows)

    (r,) = run_ranks(shared_layer_selections, 1, hf_dir, os.path.join(os.path.dirname(hf_dir), "ckpt"), rows)
    assert max_abs_diff(r["reused"], ref) < 1e-4
    assert max_abs_diff(r["no_reuse"], ref) > 1e-3  # shared layers attending to every causal key
    assert max_abs_diff(r["reused"], ref_own) > 1e-3  # shared layers selecting for themselves
    assert r["is_source"] and all(r["is_source"]), r["is_source"]
    assert any(r["differs_from_next"])  # layer 3's own selection is another one: the identity above is not trivial
    assert r["no_indexer"] == r["sglang_no_indexer"] == [1, 2]
    original = load_file(f"{hf_dir}/model.safetensors")
    assert not any(
        k.startswith(("model.layers.1.self_attn.indexer", "model.layers.2.self_attn.indexer")) for k in original
    )
    assert sorted(r["streamed"]) == sorted(original)
    assert all(torch.equal(r["streamed"][k], t) for k, t in original.items())
    assert r["unwritten"] == []


def test_shared_layers_in_tp2_pp2_ep2_equal_transformers_and_export_bitwise(shared_fsfs, tmp_path):
    import torch
    from safetensors.torch import load_file

    from conversion_workers import convert_and_score, layout_name

    hf_dir, model = shared_fsfs
    rows = make_rows(seed=3, n=7)
    ref = hf_logprobs(model.float(), rows)
    layouts = [dict(tp=2), dict(pp=2), dict(ep=2)]
    job = dict(kind="fsfs", hf_dir=hf_dir, ckpt=str(tmp_path / "ckpt"), write=dict(tp=2), read=layouts)
    results = run_ranks(convert_and_score, 2, [job], rows)[0]
    original = load_file(f"{hf_dir}/model.safetensors")
    for layout in layouts:
        r = results[("fsfs", layout_name(layout))]
        assert max_abs_diff(r["logprobs"], ref) < 1e-4, layout
        assert sorted(r["weights"]) == sorted(original), layout
        assert all(torch.equal(r["weights"][k], t) for k, t in original.items()), layout


def test_r3_replays_the_full_layers_selection_into_the_shared_layers(tmp_path):
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from indexer_replay_workers import dsa_gaps, make_dsa_records

    hf_dir = str(tmp_path / "hf")  # one indexer head: exact-zero ties the engine breaks by its own row lengths
    save_tiny_hf_model("glm_moe_dsa", hf_dir, seed=7, index_n_heads=1, index_topk=4, indexer_types=SHARED_FSFS)
    records = make_dsa_records(hf_dir)
    for rec in records:  # the shared layers' slots: their full layer's keys, as sglang captures them
        assert (rec.indexer_topk[:, 1] == rec.indexer_topk[:, 0]).all() and (
            rec.indexer_topk[:, 3] == rec.indexer_topk[:, 2]
        ).all()
    (res,) = run_ranks(dsa_gaps, 1, [dict()], hf_dir, records)
    for layout in ("padded", "packed"):
        gaps = {m: res[0][(layout, m)]["gap"] for m in ("off", "r3", "r3_shifted")}
        assert gaps["r3"] <= 1e-5, (layout, gaps)
        assert gaps["off"] > 1e-3, (layout, gaps)
        assert gaps["r3_shifted"] > 1e-3, (layout, gaps)


@pytest.mark.parametrize(
    "override",
    [
        dict(indexer_types=["shared", "full", "full", "full"]),
        dict(index_topk_pattern="SFFF"),
        dict(indexer_types=["full", "sparse", "full", "full"]),
    ],
)
def test_shared_first_layer_or_unknown_kind_refused_naming_the_field(override):
    with pytest.raises(ValueError, match="indexer_types") as e:
        FAMILY.config_fields(_cfg(**override))
    assert "\n" not in str(e.value)


def test_pipeline_stage_starting_on_a_shared_layer_refused_naming_parallel_pp():
    from gspo_megatron.models.build import check_layout

    cfg = _cfg(indexer_types=SHARED_FSSF)
    check_layout(cfg, 1, 1, 1)
    with pytest.raises(ValueError, match=r"parallel\.pp=2 starts a pipeline stage on layer 2") as e:
        check_layout(cfg, 1, 2, 1)
    assert "\n" not in str(e.value) and "[1]" in str(e.value)  # the pipeline sizes that would work
    check_layout(_cfg(indexer_types=SHARED_FSFS), 1, 2, 1)
    assert FAMILY.config_fields(cfg)["dsa_indexer_types"] == SHARED_FSSF
    assert FAMILY.config_fields(_cfg())["dsa_indexer_types"] is None  # every layer full


def test_recompute_refused_with_shared_layers():
    from gspo_megatron.models.deepseek_v32.indexer import shared_source

    config = FAMILY.megatron_config_class()(
        **FAMILY.config_fields(_cfg(indexer_types=SHARED_FSSF)),
        recompute_granularity="full",
        recompute_method="uniform",
        recompute_num_layers=1,
    )
    assert shared_source(config, 1) is None and shared_source(config, 4) is None
    with pytest.raises(ValueError, match="model.recompute=true") as e:
        shared_source(config, 2)
    assert "\n" not in str(e.value)
    config.recompute_granularity = None
    assert (shared_source(config, 2), shared_source(config, 3)) == (1, 1)


def test_config_and_dims():
    f = FAMILY.config_fields(_cfg())
    assert f["experimental_attention_variant"] == "dsa" and f["dsa_indexer_topk"] == 6
    d = FAMILY.dims(FAMILY.published["glm-5"])
    assert (d.index_n_heads, d.index_head_dim, d.index_topk, d.model_type) == (32, 128, 2048, "glm_moe_dsa")


def test_planner_counts_no_indexer_on_shared_layers():
    """The planner's parameter count equals transformers' model with full and shared layers (a shared
    layer has no indexer: tests/models/test_deepseek_v3.py checks the same for the other MLA models)."""
    from gspo_megatron.models.dims import ModelDims
    from gspo_megatron.models.tiny import hf_model_from_config
    from gspo_megatron.planner import param_counts

    for cfg in (_cfg(), _cfg(index_topk_freq=2, index_skip_topk_offset=1)):
        model = hf_model_from_config(cfg)
        d = ModelDims.from_hf_config(cfg)
        assert param_counts(d).total == sum(p.numel() for p in model.parameters()), cfg.get("index_topk_freq")
    assert ModelDims.from_hf_config(_cfg(index_topk_freq=2, index_skip_topk_offset=1)).index_shared_layers == (1, 3)
