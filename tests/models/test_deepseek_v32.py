"""deepseek_v32 family (DeepSeek Sparse Attention over MLA): the pieces the shared family tests cannot show.

- The indexer (models/deepseek_v32/indexer.py) selects exactly what transformers 5.23's
  ``DeepseekV32Indexer`` selects, ties included: with one indexer head half the scores are exact zeros
  (ReLU), many rows have zeros tied at the k-th place, and the selections are equal row by row; the
  "earliest key wins" rule would choose differently on some of those rows (so the tie handling is real).
- With sequences longer than ``index_topk`` the sparse path is the one run: transformers' output
  changes when index_topk covers the sequence; in Megatron the selection masks causal keys, the
  log-probs equal transformers' within 1e-4, and dropping the mask (dense MLA) moves them by > 1e-3.
- Packed sequences of mixed lengths (4..61 tokens, THD) and the same sequences right-padded, in 1 rank,
  TP2 and EP2: log-probs equal transformers' row by row (the indexer never selects a key of another
  packed sequence, nor runs on a padded row's padding) and the packed and padded GSPO gradients agree.
- Refusals, the Megatron config, the planner dims and the published config.
Layouts TP2 / PP2 / EP2 / TP2 x EP2 and HF -> Megatron -> HF bitwise: tests/models/test_equivalence.py.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.models import get_family
from hf_reference import hf_logprobs, make_rows, max_abs_diff
from tiny_models import tiny_hf_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pipeline"))
from packing_workers import make_records, packed_vs_padded_1_rank_tp2_ep2

FAMILY = get_family({"model_type": "deepseek_v32"})
_cfg = partial(tiny_hf_config, "deepseek_v32")


@pytest.fixture(scope="module")
def tiny(tiny_hf_checkpoint):
    hf_dir, model = tiny_hf_checkpoint("deepseek_v32", seed=11)
    return os.path.dirname(hf_dir), model  # <d>/hf; the tests convert to <d>/ckpt


# -- the indexer against transformers' ------------------------------------------------------------


def test_indexer_selects_what_transformers_selects_ties_included():
    from dsa_workers import indexer_vs_transformers

    # one indexer head: about half of all scores are exact zeros after the ReLU (ties at the k-th place)
    (r,) = run_ranks(indexer_vs_transformers, 1, _cfg(index_n_heads=1, index_topk=5), 40)
    assert r["equal"]
    assert r["tied_rows"] >= 5 and r["earliest_differs"] >= 1, r


# -- the sparse path is the one run --------------------------------------------------------------------


def test_sparse_selection_changes_transformers_output(tiny):
    from gspo_megatron.models.tiny import hf_model_from_config

    ids = torch.tensor([list(range(3, 26))])
    dense = hf_model_from_config(_cfg(index_topk=64))
    dense.load_state_dict(tiny[1].state_dict())
    with torch.no_grad():
        assert (tiny[1](ids).logits - dense(ids).logits).abs().max() > 1e-3


def test_megatron_masks_beyond_topk_and_equals_transformers(tiny):
    from dsa_workers import score_with_and_without_selection

    d, model = tiny
    rows = make_rows(seed=3, n=5)
    assert max(map(len, rows)) > FAMILY.tiny["index_topk"] + 10
    ref = hf_logprobs(model.float(), rows)
    (r,) = run_ranks(score_with_and_without_selection, 1, f"{d}/hf", f"{d}/ckpt", rows)
    assert r["masked_pairs"] > 100  # keys within causality that the selection masked
    assert max_abs_diff(r["sparse"], ref) < 1e-4
    assert max_abs_diff(r["dense"], ref) > 1e-3  # a dropped mask cannot pass


# -- packed sequences ----------------------------------------------------------------------------------


def test_packed_mixed_lengths_equal_transformers_in_1_rank_tp2_ep2(tiny):
    d, model = tiny
    rows = [r.tokens for r in make_records()]
    assert min(map(len, rows)) <= 5 and max(map(len, rows)) >= 60
    ref = hf_logprobs(model.float(), rows)
    results = packed_vs_padded_1_rank_tp2_ep2(f"{d}/hf", 64)
    for name, per_rank in results.items():
        scored = [e["score"] for e in per_rank if "score" in e]
        assert len(scored) == 1, name
        padded, packed = scored[0]
        assert max_abs_diff(packed, ref) < 1e-4, name  # packed THD rows against transformers, row by row
        # right-padded rows (4 of 4..61 tokens per micro-batch): the indexer runs on each row cut to its
        # sequence length (trainer.micro_batches.row_padding_mask), as transformers on the sequence alone
        # (before: the padded row's length broke the ReLU's exact-zero ties otherwise, up to 0.118)
        assert max_abs_diff(padded, ref) < 1e-4, name
        for e in per_rank:
            assert e["finite"] and e["grad_max"] > 1e-4, name
            assert e["grad_diff"] < 1e-5 * max(1.0, e["grad_max"]), (name, e["grad_diff"])  # one GSPO pass


# -- config, refusals, planner -------------------------------------------------------------------------


def test_megatron_config_and_dims():
    f = FAMILY.config_fields(_cfg())
    assert f["experimental_attention_variant"] == "dsa" and f["dsa_indexer_topk"] == 6
    assert (f["dsa_indexer_n_heads"], f["dsa_indexer_head_dim"], f["dsa_indexer_loss_coeff"]) == (4, 16, 0.0)
    assert f["multi_latent_attention"] and f["q_lora_rank"] == 32
    d = FAMILY.dims(FAMILY.published["deepseek-v3.2"])
    assert (d.index_n_heads, d.index_head_dim, d.index_topk, d.model_type) == (64, 128, 2048, "deepseek_v32")
    names = [r.hf for r in FAMILY.mapping(_cfg()).rules if "indexer" in str(r.hf)]
    assert len(names) == 5


@pytest.mark.parametrize(
    "override,field",
    [
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(mlp_layer_types=["sparse"] * 4), "mlp_layer_types"),
        (dict(index_head_dim=8), "index_head_dim"),
    ],
)
def test_refusals_name_the_field(override, field):
    with pytest.raises(ValueError, match=field) as e:
        FAMILY.config_fields(_cfg(**override))
    assert "\n" not in str(e.value)
