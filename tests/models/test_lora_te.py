"""LoRA on Transformer Engine's layer spec (``model.lora`` with ``model.transformer_impl=transformer_engine``,
models/lora_te.py), on CPU through the TE stand-in (``te_standin.py``: TE's parameters, splits and
reference forwards; megatron-core's own TE wrappers, layer spec, grouped-GEMM experts and optimizer
path), for the Qwen3-MoE (GQA, fused-norm qkv, grouped experts) and DeepSeek-V3 (MLA: duplicated down
projections, fused-norm up projections, shared experts) tiny models:

- every targeted TE linear has its adapters (one per routed expert of a grouped linear), only they train;
- fresh adapters leave the TE model's log-probs unchanged, and the TE model equals the local spec's;
- with the same B (and the same A: seeded by the spec-independent name) the TE and local adapters give
  the same log-probs (padded and packed), the same merged HF export, the same first-step gradients
  (routed experts named as the local spec names them) and the same trained model;
- tp2 (sequence parallel) and ep2 on TE equal one TE rank: gradients, grad norm, trained log-probs and
  merged export.
"""

from __future__ import annotations

import pytest

from distributed_harness import run_ranks
from hf_reference import make_rows, max_abs_diff
from lora_te_workers import lora_spec_layouts, run_name
from test_family_training_parity import assert_same_gradients
from test_lora import OVERRIDES
from test_uneven_expert_layouts import make_records

KINDS = ["qwen3_moe", "deepseek_v3"]  # hf_dirs (conftest.py) saves these
ROWS = make_rows(seed=4, n=4)
TE = "transformer_engine"
LAYOUTS = [dict(tp=2), dict(ep=2)]


@pytest.fixture(scope="module")
def single(hf_dirs):
    jobs = [(k, hf_dirs[k], [("local", {}), (TE, {})]) for k in KINDS]
    return run_ranks(lora_spec_layouts, 1, jobs, ROWS, make_records(), OVERRIDES, timeout=1200)[0]


@pytest.fixture(scope="module")
def multi(hf_dirs):
    jobs = [(k, hf_dirs[k], [(TE, lay) for lay in LAYOUTS]) for k in KINDS]
    return run_ranks(lora_spec_layouts, 2, jobs, ROWS, make_records(), OVERRIDES, timeout=1500)[0]


def _same_export(a: dict, b: dict, tol: float) -> None:
    assert set(a) == set(b)
    worst = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    assert worst <= tol, worst


@pytest.mark.parametrize("kind", KINDS)
def test_every_te_linear_has_adapters(single, kind):
    local, te = single[kind]["local-tp1"], single[kind]["te-tp1"]
    classes = set(te["adapters"].values())
    assert {"LoraTELayerNormColumnParallelLinear", "LoraTERowParallelLinear"} <= classes
    assert {"LoraTEColumnParallelGroupedLinear", "LoraTERowParallelGroupedLinear"} <= classes
    if kind == "deepseek_v3":
        assert {"LoraTELinear", "LoraTEColumnParallelLinear"} <= classes  # MLA down projections, shared experts
    assert len(te["adapters"]) == len(local["adapters"]), "one adapter per local-spec adapter (experts one each)"
    assert te["trainable"] and all(".lora_A" in n or ".lora_B" in n for n in te["trainable"])
    assert set(te["grads"]) == set(local["grads"])


@pytest.mark.parametrize("kind", KINDS)
def test_te_adapters_equal_local_ones(single, kind):
    local, te = single[kind]["local-tp1"], single[kind]["te-tp1"]
    assert max_abs_diff(te["base"], local["base"]) < 1e-6
    assert max_abs_diff(te["fresh"], te["base"]) < 1e-6
    assert max_abs_diff(te["b"], local["b"]) < 1e-6
    assert max_abs_diff(te["b"], te["base"]) > 1e-3, "B != 0 moves the log-probs"
    assert max_abs_diff(te["b_packed"], te["b"]) < 1e-5
    _same_export(te["b_export"], local["b_export"], 1e-6)
    assert_same_gradients(te["grads"], local["grads"])
    assert te["metrics"]["train/grad_norm"] == pytest.approx(local["metrics"]["train/grad_norm"], rel=1e-5)
    assert max_abs_diff(te["trained"], te["b"]) > 1e-3, "training moved the policy"
    assert max_abs_diff(te["trained"], local["trained"]) < 1e-5
    # Adam's two steps (lr 3e-3) amplify the gradients' rounding where a gradient is near 0: 1.3e-5 seen
    _same_export(te["trained_export"], local["trained_export"], 1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: run_name(TE, lay))
def test_te_layouts_equal_one_rank(single, multi, kind, layout):
    ref, r = single[kind]["te-tp1"], multi[kind][run_name(TE, layout)]
    assert max_abs_diff(r["b"], ref["b"]) < 1e-5
    assert_same_gradients(r["grads"], ref["grads"])
    assert r["metrics"]["train/grad_norm"] == pytest.approx(ref["metrics"]["train/grad_norm"], rel=1e-4)
    assert max_abs_diff(r["trained"], ref["trained"]) < 1e-4
    _same_export(r["trained_export"], ref["trained_export"], 1e-4)
