"""FP8 padding (issue 21, defect 5): with ``model.fp8`` on, rows and packed micro-batches are padded
so that every Transformer Engine GEMM's token dim is aligned on every rank, and the padding changes
neither the loss nor the log-probs.

The rule, transcribed from transformer-engine 2.20.2's source (``te_token_dim_ok`` below):
``pytorch/utils.py`` ``assert_dim_for_fp8_exec`` -- raised by ``module/linear.py`` (and
``layernorm_linear.py``, ``layernorm_mlp.py``) whenever fp8 is on -- needs the product of an input's
leading dims (its tokens) divisible by 8 and its last dim by 16; the weight-gradient GEMM takes the
transposed input, whose last dim is the tokens: 16; ``pytorch/quantization.py``
``get_align_size_for_quantization`` (the grouped-GEMM padding, ``module/fp8_padding.py``) is 32 for
MXFP8, 16 otherwise. A rank's local input is its share of the row: /cp (context parallel's 2*cp
chunks), and /tp for column-parallel layers with sequence parallelism.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.trainer.micro_batches import fp8_alignment, sequence_multiple

RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def te_token_dim_ok(n: int, recipe: str) -> bool:
    """TE 2.20.2: the token dim of an FP8 GEMM input (module docstring)."""
    return n % 8 == 0 and n % (32 if recipe == "mxfp8" else 16) == 0


def local_token_dims(width: int, rows: int, tp: int, sp: bool, cp: int) -> list[int]:
    """Token dims on one rank of a micro-batch of ``rows`` rows of ``width`` tokens: the column-
    parallel layers' local input (sequence-parallel shard) and the row-parallel layers' input."""
    per_cp = rows * width // cp
    return [per_cp // tp if sp else per_cp, per_cp]


def layout_ok(width: int, tp: int, sp: bool, cp: int) -> bool:
    """The splits themselves: sequence parallel cuts a row into tp parts, CP into 2*cp chunks of a
    multiple of tp tokens each (Megatron's get_batch_on_this_cp_rank)."""
    return width % tp == 0 and (cp == 1 or width % (2 * cp * tp) == 0)


GRID = list(itertools.product((1, 2, 4, 8), (False, True), (1, 2, 4), RECIPES))


@pytest.mark.parametrize("tp,sp,cp,recipe", GRID)
def test_multiple_meets_te_rule_and_is_the_smallest(tp, sp, cp, recipe):
    if sp and tp == 1:
        return  # Megatron turns sequence parallelism off without TP
    m = sequence_multiple(tp, cp, fp8="e4m3", sp=sp, fp8_recipe=recipe)
    assert m == sequence_multiple(tp, cp, fp8="hybrid", sp=sp, fp8_recipe=recipe)
    # every row width the padding can produce, with any number of rows, on every rank
    for k in (1, 2, 3, 7):
        for rows in (1, 2, 3, 4, 5):
            assert layout_ok(k * m, tp, sp, cp)
            for n in local_token_dims(k * m, rows, tp, sp, cp):
                assert te_token_dim_ok(n, recipe), (k * m, rows, n)
    # and no smaller width works for a single row (a packed micro-batch is one row)
    for w in range(1, m):
        assert not (
            layout_ok(w, tp, sp, cp) and all(te_token_dim_ok(n, recipe) for n in local_token_dims(w, 1, tp, sp, cp))
        ), w


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_without_fp8_the_multiple_is_the_splits_alone(tp, cp):
    assert sequence_multiple(tp, cp) == sequence_multiple(tp, cp, fp8=None, sp=True) == (2 * cp * tp if cp > 1 else tp)


def test_alignment_is_megatrons_fp8_alignment():
    """The experts' per-expert token counts are padded by Megatron (TEGroupedMLP's Fp8Padding and,
    set by runtime.fp8, moe_router_padding_for_quantization) to get_fp8_align_size: the same A."""
    from megatron.core.fp8_utils import get_fp8_align_size

    from gspo_megatron.runtime.fp8 import FP8Options

    for recipe in RECIPES:
        assert fp8_alignment(recipe) == get_fp8_align_size(recipe)
        kw = FP8Options(fp8="e4m3", recipe=recipe).transformer_config_kwargs(is_moe=True, token_dispatcher="alltoall")
        assert kw["moe_router_padding_for_quantization"] is True


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("budget", [0, 96], ids=["padded", "packed"])
def test_context_parallel_rows_meet_te_rule_on_every_rank(tp, budget):
    """cp=2 (two gloo ranks; the model cannot run CP on CPU): the trainer's split_batch with
    model.fp8 on gives every CP rank a share whose token dims meet TE's rule, also after the
    sequence-parallel split."""
    from fp8_padding_workers import cp_rows, make_records

    ranks = run_ranks(cp_rows, 2, tp, budget)
    total_mask = 0.0
    for rank_rows in ranks:
        assert rank_rows
        for (rows, local), mask, computed in rank_rows:
            assert computed == rows * local * 2  # whole rows, before the CP split
            for n in local_token_dims(local * 2, rows, tp, tp > 1, 2):
                assert te_token_dim_ok(n, "delayed"), (rows, local, n)
            total_mask += mask
    assert total_mask == sum(r.response_len for r in make_records())  # every response token, once


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_moe", seed=5)[0]


def test_fp8_padding_meets_te_rule_and_keeps_loss_and_logprobs(hf_dir):
    """tp2 and tp1 (dp2), padded and packed, on the tiny MoE through the trainer's code: with
    model.fp8 every decoder linear layer's input token dim meets TE's rule on every rank (it does
    not without it), and the log-probs, loss and gradients are those of the plain padding."""
    from fp8_padding_workers import fp8_vs_plain

    ranks = run_ranks(fp8_vs_plain, 2, [dict(tp=2), dict()], hf_dir, 96)
    for li, name in enumerate(("tp2", "tp1-dp2")):
        for r, rank_res in enumerate(ranks):
            e = rank_res[li]
            for mode in ("padded", "packed"):
                plain, fp8 = e[mode]["plain"], e[mode]["fp8"]
                where = f"{name} rank {r} {mode}"
                assert fp8["linear_dims"], where
                bad = [(n, d) for n, d in fp8["linear_dims"] if not te_token_dim_ok(d, "delayed")]
                assert not bad, (where, bad[:4])
                # the check has teeth: the plain padding feeds TE shapes it would refuse
                assert any(not te_token_dim_ok(d, "delayed") for _, d in plain["linear_dims"]), where
                assert fp8["shapes"] != plain["shapes"], where
                assert fp8["loss"] != 0.0
                assert fp8["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-6), where
                assert e[mode]["grad_max"] > 1e-4
                assert e[mode]["grad_diff"] <= 1e-5 * max(1.0, e[mode]["grad_max"]), (where, e[mode]["grad_diff"])
                assert sorted(fp8["logprobs"]) == sorted(plain["logprobs"]), where
                for sid, lp in plain["logprobs"].items():
                    a, b = torch.tensor(lp), torch.tensor(fp8["logprobs"][sid])
                    assert a.shape == b.shape and a.numel() > 0
                    torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=f"{where} sequence {sid}")
            step = e["train_on_batch"]
            assert step["linear_dims"] and math.isfinite(step["loss"]), name
            bad = [(n, d) for n, d in step["linear_dims"] if not te_token_dim_ok(d, "delayed")]
            assert not bad, (name, "train_on_batch", bad[:4])
