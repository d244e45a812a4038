"""glm_moe_dsa family (GLM-5: DeepSeek-V3.2's architecture with an interleaved-RoPE indexer): what the
shared family tests cannot show.

- The indexer (``InterleavedLightningIndexer``) selects exactly what transformers 5.23's
  ``GlmMoeDsaIndexer`` selects, ties included (one indexer head: many exact-zero ties at the k-th place);
  the rotate-half RoPE of DeepSeek-V3.2 selects otherwise on the same weights (so the RoPE style is real).
- Sequences longer than ``index_topk``: Megatron's log-probs equal transformers' within 1e-4 and the
  selection masks causal keys (dropping it moves them by > 1e-3).
- Packed sequences of mixed lengths and the same sequences right-padded, in 1 rank, TP2 and EP2: equal
  to transformers' row by row; packed and padded GSPO gradients agree.
- ``indexer_types`` with ``"shared"`` layers is refused naming the field; the published config's dims.
Layouts TP2 / PP2 / EP2 / TP2 x EP2 and HF -> Megatron -> HF bitwise: tests/models/test_equivalence.py.
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


def test_packed_and_padded_mixed_lengths_equal_transformers_in_1_rank_tp2_ep2(tiny):
    d, model = tiny
    rows = [r.tokens for r in make_records()]
    ref = hf_logprobs(model.float(), rows)
    results = packed_vs_padded_1_rank_tp2_ep2(f"{d}/hf", 64)
    for name, per_rank in results.items():
        scored = [e["score"] for e in per_rank if "score" in e]
        assert len(scored) == 1, name
        padded, packed = scored[0]
        assert max_abs_diff(packed, ref) < 1e-4, name
        assert max_abs_diff(padded, ref) < 1e-4, name
        for e in per_rank:
            assert e["finite"] and e["grad_max"] > 1e-4, name
            assert e["grad_diff"] < 1e-5 * max(1.0, e["grad_max"]), (name, e["grad_diff"])


@pytest.mark.parametrize(
    "override",
    [
        dict(indexer_types=["full", "shared", "full", "full"]),
        dict(index_topk_freq=2, index_skip_topk_offset=1),
        dict(index_topk_pattern="FFSF"),
    ],
)
def test_shared_indexer_layers_refused_naming_the_field(override):
    with pytest.raises(ValueError, match="indexer_types") as e:
        FAMILY.config_fields(_cfg(**override))
    assert "\n" not in str(e.value)


def test_config_and_dims():
    f = FAMILY.config_fields(_cfg())
    assert f["experimental_attention_variant"] == "dsa" and f["dsa_indexer_topk"] == 6
    d = FAMILY.dims(FAMILY.published["glm-5"])
    assert (d.index_n_heads, d.index_head_dim, d.index_topk, d.model_type) == (32, 128, 2048, "glm_moe_dsa")
