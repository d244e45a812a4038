"""One GSPO training step (old log-probs, two optimizer steps) of each family's tiny model gives the
same loss, gradient norm and ratio in TP2 and in EP2 as on one rank (rel 1e-4), the same reduced
gradient for every parameter in the first step (gathered to full size, so a regression names the
parameter), the same grad norm on every rank, and the scorer's log-probs equal transformers' forward.
Families: the MoE ones with their own architecture pieces (deepseek_v3: MLA, sigmoid router with
correction bias, shared expert, dense layer; glm4_moe: q/k/v bias, QK-norm, partial rotary, shared
expert; qwen2_moe: gated shared expert; gpt_oss: attention sinks (TP-split: their gradients count once
per rank in the norm), sliding window, YaRN, biased experts with the clamped SwiGLU, router bias;
minimax_m2: the q/k norm over all heads, its weight TP-split and its statistic all-reduced over TP;
deepseek_v32: deepseek_v3 + the DSA indexer (frozen: no gradient) on right-padded rows of mixed lengths;
glm_moe_dsa: the same with GLM-5's interleaved-RoPE indexer).
Expert loads are uneven (random tokens).

Layouts on 2 gloo ranks: tp2 (ETP = TP), ep2, and tp2 x etp1 (experts replicated over the two TP
ranks, expert-data-parallel size 2; gpt_oss's only TP2 layout, as Megatron-Core allows expert biases
with ETP1 only). Three Megatron-Core 0.16.1 bugs this catches, fixed in the package: replicated experts
(EP1, ETP < TP) whose gradients were never summed over the TP ranks (models/build.py
``mark_replicated_experts``); the expert optimizer's norm dropping non-split expert parameters (biases)
on dense TP rank 1 (trainer/optimizer.py ``use_expert_tp_group_for_norm``); MLA's RoPE key losing the other TP
ranks' heads' gradient on the local spec (deepseek_v3/local_attention.py).

Cost: every family's checkpoint is built once, all single-rank references run in one spawned process
and all 2-rank layouts of all families in one spawned pair of ranks (module fixtures)."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from hf_reference import hf_logprobs, make_rows, max_abs_diff
from test_uneven_expert_layouts import OVERRIDES, make_records
from uneven_expert_workers import score_and_train_many

ROWS = make_rows(seed=3, n=5)
FAMILIES = [
    "gpt_oss",
    "deepseek_v3",
    "glm4_moe",
    "qwen2_moe",
    "minimax_m2",
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v32",
    "glm_moe_dsa",
]
TP2, EP2, TP2_ETP1 = dict(tp=2), dict(ep=2), dict(tp=2, etp=1)
# gpt_oss: Megatron-Core allows expert biases only with expert tensor parallel size 1
LAYOUTS = {
    "gpt_oss": [TP2_ETP1, EP2],
    "deepseek_v3": [TP2, EP2, TP2_ETP1],
    "glm4_moe": [TP2, EP2],
    "qwen2_moe": [TP2, EP2, TP2_ETP1],
    "minimax_m2": [TP2, EP2, TP2_ETP1],
    "qwen3_next": [TP2, EP2],
    "qwen3_5_moe": [TP2],
    "deepseek_v32": [TP2, EP2, TP2_ETP1],
    "glm_moe_dsa": [TP2, EP2],
}
PARAMS = [(k, "+".join(f"{a}{b}" for a, b in sorted(lay.items()))) for k in FAMILIES for lay in LAYOUTS[k]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    out = {}
    for kind in FAMILIES:
        hf_dir = str(tmp_path_factory.mktemp(kind) / "hf")
        out[kind] = (hf_dir, hf_logprobs(save_tiny_hf_model(kind, hf_dir, seed=11).float(), ROWS))
    return out


def _run(checkpoints, world, layouts):
    jobs = [(kind, checkpoints[kind][0], layouts(kind)) for kind in FAMILIES]
    return run_ranks(score_and_train_many, world, jobs, ROWS, make_records(), OVERRIDES, True)[0]


@pytest.fixture(scope="module")
def single(checkpoints):
    return {kind: r["tp1"] for kind, r in _run(checkpoints, 1, lambda kind: [dict()]).items()}


@pytest.fixture(scope="module")
def multi(checkpoints):
    return _run(checkpoints, 2, lambda kind: LAYOUTS[kind])


def assert_same_gradients(result: dict, reference: dict) -> None:
    """Every parameter's first-step gradient: |g - g_ref| <= 1e-4 |g_ref| + 1e-5 |g_ref|_max-param."""
    assert result.keys() == reference.keys()
    scale = max(float(g.norm()) for g in reference.values())
    bad = []
    for name, ref in reference.items():
        g = result[name]
        if g.shape != ref.shape:  # a padded vocabulary: the rows both layouts have
            rows = min(g.shape[0], ref.shape[0])
            g, ref = g[:rows], ref[:rows]
        err = float((g - ref).norm())
        if err > 1e-4 * float(ref.norm()) + 1e-5 * scale:
            bad.append(f"{name}: |g - g_1rank| / |g_1rank| = {err / max(float(ref.norm()), 1e-30):.3g}")
    assert not bad, "gradients differ from one rank's:\n" + "\n".join(bad)


@pytest.mark.parametrize("kind", FAMILIES)
def test_single_rank_trains_and_scores_like_transformers(single, checkpoints, kind):
    ref = single[kind]
    assert ref["metrics"]["train/grad_norm"] > 0 and ref["metrics"]["train/skipped_updates"] == 0
    assert max_abs_diff(ref["logprobs"], checkpoints[kind][1]) < 1e-4
    # the captured gradients are the ones the grad norm is made of (no parameter left out)
    first_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref["grads"].values())))
    assert first_norm > 0 and all(torch.isfinite(g).all() for g in ref["grads"].values())


@pytest.mark.parametrize("kind,layout", PARAMS)
def test_two_ranks_train_like_one_rank(single, multi, checkpoints, kind, layout):
    ref, result = single[kind], multi[kind][layout]
    assert max_abs_diff(result["logprobs"], checkpoints[kind][1]) < 1e-4
    for key in ("loss/total", "train/grad_norm", "gspo/ratio_mean"):
        assert result["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-4, abs=1e-7), key
    assert result["metrics"]["train/skipped_updates"] == 0
    assert len(set(result["grad_norms"])) == 1, f"ranks disagree on the grad norm: {result['grad_norms']}"
    assert_same_gradients(result["grads"], ref["grads"])
