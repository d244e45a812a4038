"""GPU test: FP8 training through OUR pipeline (issue 21, defect 5). Needs Transformer Engine and an
FP8-capable GPU (compute capability >= 8.9; blockwise 9.0, mxfp8 10.0: ``runtime.fp8.MIN_CAPABILITY``).

What a user's run does, on the demo's tiny Qwen3-MoE (``model.arch=tiny-qwen3-moe``): the config
(``model.fp8``, ``model.fp8_recipe``, ``model.transformer_impl=transformer_engine``) ->
``factory.build_model`` (TE layer spec, ``runtime.fp8`` fields, MoE router padding) -> Megatron DDP +
optimizer (``optim.setup_training``) -> ``train_step.train_on_batch`` on mixed-length sequences,
packed (``parallel.max_tokens_per_micro_batch``) and padded, and the scorer (``score.score_rows``).
The lengths are chosen so that padding to tp/cp alone gives token counts Transformer Engine refuses
(an odd total; a 4-row micro-batch 61 wide); the last part shows that TE does refuse them
(``transformer_engine/pytorch/utils.py`` ``assert_dim_for_fp8_exec``) when the FP8 padding is
taken away. The CPU tests (tests/pipeline/test_fp8_padding.py) check the shapes on every rank for
tp/cp 1 and 2 and that the padding leaves log-probs, loss and gradients unchanged.

Only pytest and torch are imported at module level: the file collects on CPU machines.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pipeline"))

BUDGET = 96  # packed micro-batches of at most 96 tokens (the longest sequence has 61)


def _config(recipe: str | None, budget: int):
    from gspo_megatron.config import load_config

    o = [
        "model.arch=tiny-qwen3-moe",
        "model.init=random",
        "model.dtype=bfloat16",
        "model.transformer_impl=transformer_engine",
        "parallel.micro_batch_size=4",
        f"parallel.max_tokens_per_micro_batch={budget}",
        "gspo.mini_batches=1",
        "optimizer.lr=1e-4",
    ]
    if recipe is not None:
        o += ["model.fp8=hybrid", f"model.fp8_recipe={recipe}"]
    return load_config(None, o)


def fp8_step(rank: int, world: int, recipe: str) -> dict:
    """One process, one GPU (spawned by the test: a fresh process group per recipe)."""
    from megatron.core.utils import get_model_config

    from fp8_padding_workers import make_records
    from gspo_megatron import factory
    from gspo_megatron.models.arch import model_hf_config
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.score import score_rows
    from gspo_megatron.trainer import step as train_step
    from gspo_megatron.trainer.micro_batches import sequence_multiple
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training
    from gspo_megatron.trainer.step import train_on_batch

    init_distributed(ParallelLayout(), seed=0)
    fp8_cfg, bf16_cfg = _config(recipe, BUDGET), _config(None, BUDGET)
    hf, _ = model_hf_config(fp8_cfg)
    records = make_records(vocab=hf["vocab_size"])
    lengths = [r.length for r in records]
    # without the FP8 padding TE would see an odd token count (packed) and 4 rows of 61 (padded)
    assert sum(lengths) % 2 == 1 and (4 * max(lengths[:4])) % 8 != 0

    ref = factory.build_model(bf16_cfg, hf)
    model = factory.build_model(fp8_cfg, hf)
    mc = get_model_config(model)
    assert mc.fp8 == "hybrid" and mc.fp8_recipe == recipe and mc.moe_router_padding_for_quantization
    assert any(type(m).__module__.startswith("megatron.core.extensions.transformer_engine") for m in model.modules()), (
        "the TE layer spec was not used"
    )
    with torch.no_grad():  # the same weights in both (bf16 parameters, fp8_param off), before the optimizers copy them
        ref_params = dict(ref.named_parameters())
        assert sorted(n for n, _ in model.named_parameters()) == sorted(ref_params)
        for n, p in model.named_parameters():
            p.copy_(ref_params[n])
    ref_ddp, ref_opt, ref_sched = setup_training(ref, OptimOptions(lr=1e-4, total_steps=8))
    ddp, opt, sched = setup_training(model, OptimOptions(lr=1e-4, total_steps=8))

    # the scorer through the FP8 model, padded and packed, against the bf16 model
    rows = [r.tokens for r in records]
    want = score_rows(ref_ddp, rows, micro_batch_size=4)
    out = {"score_mean_absdiff": {}}
    for name, kw in (("padded", dict(micro_batch_size=4)), ("packed", dict(max_tokens_per_micro_batch=BUDGET))):
        got = score_rows(ddp, rows, **kw)
        diffs = torch.cat([(torch.tensor(g) - torch.tensor(w)).abs() for g, w in zip(got, want)])
        assert diffs.numel() == sum(n - 1 for n in lengths)
        out["score_mean_absdiff"][name] = float(diffs.mean())
        assert float(diffs.mean()) < 0.05 and float(diffs.max()) < 0.5, (name, float(diffs.mean()))

    # one training step each, packed then padded (rows padded by train_step.row_multiple)
    for budget in (BUDGET, 0):
        ref_res = train_on_batch(_config(None, budget), ref_ddp, ref_opt, ref_sched, records, pad_id=0)
        res = train_on_batch(_config(recipe, budget), ddp, opt, sched, records, pad_id=0)
        assert not res.nonfinite and not ref_res.nonfinite, budget
        for k in ("loss/total", "train/grad_norm", "policy/entropy"):
            assert math.isfinite(res.metrics[k]), (budget, k)
        assert res.metrics["train/grad_norm"] > 0
        # near-uniform predictions of a random-init model: FP8 rounding moves the entropy very little
        assert res.metrics["policy/entropy"] == pytest.approx(ref_res.metrics["policy/entropy"], rel=0.05)
        out[f"metrics_{budget}"] = res.metrics
    assert all(torch.isfinite(p).all() for p in ddp.module.parameters())

    # the defect itself: rows padded for tp/cp only (the code before the fix): TE refuses the shapes
    train_step.row_multiple = lambda cfg, tp, cp: sequence_multiple(tp, cp)
    for budget in (BUDGET, 0):
        with pytest.raises(ValueError, match="FP8 execution requires"):
            train_on_batch(_config(recipe, budget), ddp, opt, sched, records, pad_id=0)
    return out


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_step_through_our_pipeline(recipe):
    pytest.importorskip("transformer_engine")
    from gspo_megatron.runtime.fp8 import MIN_CAPABILITY

    if torch.cuda.get_device_capability() < MIN_CAPABILITY[recipe]:
        pytest.skip(f"fp8 recipe {recipe} needs compute capability >= {MIN_CAPABILITY[recipe]}")
    from distributed_harness import run_ranks

    (out,) = run_ranks(fp8_step, 1, recipe)
    assert set(out["score_mean_absdiff"]) == {"padded", "packed"}
