"""One GSPO training step (old log-probs, two optimizer steps) of each family's tiny model gives the
same loss, gradient norm and ratio in TP2 and in EP2 as on one rank (rel 1e-4), and the scorer's
log-probs equal transformers' forward. Families: the MoE ones with their own architecture pieces
(deepseek_v3: MLA, sigmoid router with correction bias, shared expert, dense layer; glm4_moe: q/k/v
bias, QK-norm, partial rotary, shared expert; qwen2_moe: gated shared expert; gpt_oss: attention sinks
(TP-split: their gradients count once per rank in the norm), sliding window, YaRN, biased experts with
the clamped SwiGLU, router bias). Expert loads are uneven (random tokens). 2 gloo ranks per family."""

from __future__ import annotations

import pytest

from distributed_harness import run_ranks
from hf_reference import hf_logprobs, make_rows, max_abs_diff
from test_uneven_expert_layouts import OVERRIDES, make_records
from uneven_expert_workers import score_and_train

ROWS = make_rows(seed=3, n=5)
FAMILIES = ["gpt_oss", "deepseek_v3", "glm4_moe", "qwen2_moe"]
# gpt_oss: Megatron-Core allows expert biases only with expert tensor parallel size 1
TP2 = {"gpt_oss": dict(tp=2, etp=1)}


# Known, not gpt_oss's: TP2 with expert tensor parallel 1 and EP1 trains differently from one rank for
# every MoE family (qwen3_moe too, measured 2026-11-23; the scorer's log-probs match), so gpt_oss, which
# needs ETP1, cannot show TP2 training parity until that layout is fixed.
# Known, found by this test: deepseek_v3 in TP2 (ETP2) trains differently from one rank (its scorer
# log-probs match); unexplained yet (a suspect: Megatron sums q_layernorm / kv_layernorm gradients over
# TP for qk_layernorm, while the local MLA spec computes those norms on gathered, replicated inputs).
KNOWN = {("gpt_oss", "tp2"): "tp2 x etp1 x ep1 training differs for every MoE family (qwen3_moe too)",
         ("deepseek_v3", "tp2"): "deepseek_v3 TP2 training differs from one rank (MLA norms under TP?)"}
PARAMS = [pytest.param(k, lay, marks=pytest.mark.xfail(strict=True, reason=KNOWN[(k, lay)]))
          if (k, lay) in KNOWN else (k, lay) for k in FAMILIES for lay in ("tp2", "ep2")]


@pytest.mark.parametrize("kind,layout", PARAMS)
def test_tp2_and_ep2_train_like_one_rank(tmp_path, kind, layout):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    hf_dir = str(tmp_path / "hf")
    ref = hf_logprobs(save_tiny_hf_model(kind, hf_dir, seed=11).float(), ROWS)
    records = make_records()
    single = run_ranks(score_and_train, 1, hf_dir, [dict()], ROWS, records, OVERRIDES)[0]["tp1"]
    lay = TP2.get(kind, dict(tp=2)) if layout == "tp2" else dict(ep=2)
    multi = run_ranks(score_and_train, 2, hf_dir, [lay], ROWS, records, OVERRIDES)[0]
    assert single["metrics"]["train/grad_norm"] > 0 and single["metrics"]["train/skipped_updates"] == 0
    assert max_abs_diff(single["logprobs"], ref) < 1e-4
    assert len(multi) == 1
    for name, result in multi.items():
        assert max_abs_diff(result["logprobs"], ref) < 1e-4, name
        for key in ("loss/total", "train/grad_norm", "gspo/ratio_mean"):
            assert result["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-4, abs=1e-7), (name, key)
        assert result["metrics"]["train/skipped_updates"] == 0
