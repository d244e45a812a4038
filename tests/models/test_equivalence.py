"""HF -> Megatron -> (score, HF) against transformers itself, on 4 gloo ranks.

Tiny random models written by transformers' own classes (qwen3_moe, mixtral, qwen2_moe with its
gated shared expert and a dense layer, deepseek_v3 (MLA with q_lora_rank, YaRN with mscale,
interleaved RoPE, sigmoid router with a random e_score_correction_bias, group-limited top-k, routed
scaling, a shared expert, a dense first layer) and its variant without q_lora_rank, with default RoPE
and rope_interleave=false, glm4_moe (q/k/v bias, QK-norm, partial rotary, the same router, shared
expert, dense first layer) and its plain variant, qwen2 with tied embeddings, qwen3 in bfloat16,
gpt_oss (attention sinks, sliding-window layers, YaRN with truncate=false, router bias, experts
stacked in the checkpoint with biases and the clamped SwiGLU), qwen3_moe and qwen3 with YaRN,
minimax_m2 (q/k RMSNorm over all heads, TP-split; partial rotary; sigmoid router with a random
correction bias; Mixtral-named experts), qwen3_next (Gated DeltaNet layers mixed with gated full
attention, zero-centered norms, partial rotary, shared expert with a gate), qwen3_5_moe (the same with
the split Gated DeltaNet projections and multimodal RoPE on text), deepseek_v32 (deepseek_v3
plus the DSA lightning indexer with index_topk below the rows' lengths; padded rows of mixed lengths),
glm_moe_dsa (the same with GLM-5's interleaved-RoPE indexer)) are
converted to Megatron checkpoints in one layout (TP2 x DP2)
and read back in others (TP2, PP2, EP2, TP2 x EP2 with ETP1, DP4). In each layout:
- the scorer's log-probs (vocab-parallel, pipelined, data-parallel split) match transformers'
  forward within 1e-4 (fp32); in bfloat16, within 3x transformers' own bf16-vs-fp32 deviation,
  a bound that zeroing any one layer's MLP exceeds (so a broken layer cannot pass);
- the exported HF weights equal the original safetensors bitwise (same names, same tensors).
The conversions run in one spawned 4-rank job, layout-major (tests/models/equivalence_workers.py): the
parallel state is set up once per layout and every case converted or read in it there (setting it up
cost more than converting and reading a tiny model); each (case, layout) still builds its own model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from conversion_workers import layout_name
from distributed_harness import run_ranks
from equivalence_workers import convert_and_score_by_layout
from hf_reference import hf_logprobs, make_rows, max_abs_diff

MOE_LAYOUTS = [dict(tp=2), dict(pp=2), dict(ep=2), dict(tp=2, ep=2, etp=1), dict()]
# expert biases (gpt_oss): Megatron-Core needs expert tensor parallel size 1
ETP1_LAYOUTS = [dict(tp=2, etp=1), dict(pp=2), dict(ep=2), dict(tp=2, ep=2, etp=1), dict()]
WRITE = {"gpt_oss": dict(tp=2, etp=1)}  # the layout a case is converted in (default TP2)
DENSE_LAYOUTS = [dict(tp=2), dict(pp=2), dict(tp=2, pp=2)]
CASES = [
    ("qwen3_moe", torch.float32, MOE_LAYOUTS),
    ("mixtral", torch.float32, MOE_LAYOUTS),
    ("qwen2_moe", torch.float32, MOE_LAYOUTS),
    ("deepseek_v3", torch.float32, MOE_LAYOUTS),
    ("deepseek_v3_plain", torch.float32, [dict(tp=2), dict(ep=2)]),
    ("glm4_moe", torch.float32, MOE_LAYOUTS),
    ("glm4_moe_plain", torch.float32, [dict(tp=2)]),
    ("qwen2", torch.float32, DENSE_LAYOUTS),
    ("qwen3", torch.bfloat16, [dict(pp=2)]),
    ("gpt_oss", torch.float32, ETP1_LAYOUTS),
    ("qwen3_moe_yarn", torch.float32, [dict(tp=2), dict(ep=2)]),
    ("qwen3_yarn", torch.float32, [dict(tp=2, pp=2)]),
    ("minimax_m2", torch.float32, MOE_LAYOUTS),
    ("qwen3_next", torch.float32, MOE_LAYOUTS),
    ("qwen3_5_moe", torch.float32, MOE_LAYOUTS),
    ("deepseek_v32", torch.float32, MOE_LAYOUTS),
    ("glm_moe_dsa", torch.float32, MOE_LAYOUTS),
]
# case name -> (family, overrides of its tiny config)
VARIANTS = {
    "deepseek_v3_plain": ("deepseek_v3", dict(q_lora_rank=None, rope_scaling=None, rope_interleave=False)),
    "glm4_moe_plain": (
        "glm4_moe",
        dict(use_qk_norm=False, attention_bias=False, partial_rotary_factor=1.0, n_group=1, topk_group=1),
    ),
    # YaRN on grouped-query attention (Qwen3 long-context checkpoints): transformers' defaults,
    # and an explicit attention factor with truncate=false
    "qwen3_moe_yarn": (
        "qwen3_moe",
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)),
    ),
    "qwen3_yarn": (
        "qwen3",
        dict(
            rope_scaling=dict(
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=8,
                attention_factor=1.3,
                beta_fast=16,
                truncate=False,
            )
        ),
    ),
}
ROWS = make_rows(seed=3, n=7)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("equivalence")
    refs, originals, jobs = {}, {}, []
    for kind, dtype, layouts in CASES:
        hf_dir = str(root / f"hf_{kind}")
        family, overrides = VARIANTS.get(kind, (kind, {}))
        model = save_tiny_hf_model(family, hf_dir, seed=11, dtype=dtype, **overrides)
        if dtype == torch.bfloat16:
            refs["bf16 noise"] = bf16_noise_and_broken_layers(model)
        refs[kind] = hf_logprobs(model.float(), ROWS)
        originals[kind] = load_file(f"{hf_dir}/model.safetensors")
        jobs.append(
            dict(
                kind=kind,
                hf_dir=hf_dir,
                ckpt=str(root / f"ckpt_{kind}"),
                write=WRITE.get(kind, dict(tp=2)),
                read=layouts,
            )
        )
    # one spawned job: starting 4 ranks (torch and Megatron imports on each) costs more than converting
    # and scoring a tiny model; layout-major, all cases take about 1 minute on 2 free cores (the
    # harness's limit is 10). Per (case, layout) re-initialization, as conversion_workers.convert_and_score
    # does, took 2.4x as long (160 s).
    results = run_ranks(convert_and_score_by_layout, 4, jobs, ROWS)[0]
    return refs, originals, results


def bf16_noise_and_broken_layers(model) -> dict:
    """For a bf16 transformers model: its own bf16 rounding noise (max |log-prob in bf16 - log-prob of
    the same weights in fp32|) and, per layer, how far zeroing that layer's MLP moves the fp32 log-probs."""
    fp32 = hf_logprobs(copy.deepcopy(model).float(), ROWS)
    noise = max_abs_diff(hf_logprobs(model, ROWS), fp32)
    broken = []
    for i in range(model.config.num_hidden_layers):
        b = copy.deepcopy(model).float()
        with torch.no_grad():
            for p in b.model.layers[i].mlp.parameters():
                p.zero_()
        broken.append(max_abs_diff(hf_logprobs(b, ROWS), fp32))
    return {"noise": noise, "broken_layer_shift": broken}


PARAMS = [(kind, layout_name(layout)) for kind, _, layouts in CASES for layout in layouts]


@pytest.mark.parametrize("kind,layout", PARAMS)
def test_export_is_bitwise_identical(converted, kind, layout):
    _, originals, results = converted
    exported = results[(kind, layout)]["weights"]
    original = originals[kind]
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype, name
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("kind,layout", [p for p in PARAMS if p[0] != "qwen3"])
def test_scorer_matches_transformers(converted, kind, layout):
    refs, _, results = converted
    got = results[(kind, layout)]["logprobs"]
    assert [len(r) for r in got] == [len(r) - 1 for r in ROWS]
    assert max_abs_diff(got, refs[kind]) < 1e-4


def test_bf16_scorer_close_to_transformers(converted):
    """bfloat16 weights: both sides round differently, so agreement is to bf16 accuracy only. The bound
    is measured, not guessed: transformers' own bf16 forward deviates from fp32 by ``noise`` (~3e-3 on
    this model); Megatron's bf16 forward (other kernels, other summation order) may deviate a few
    times that. 3x noise (~1e-2) still catches a broken layer: zeroing any one layer's MLP moves the
    log-probs by 0.04 or more, which the second assertion checks on this very model."""
    refs, _, results = converted
    noise = refs["bf16 noise"]["noise"]
    assert 0 < noise < 0.01  # bf16 rounding of a 4-layer model: a few 1e-3
    tolerance = 3 * noise
    assert max_abs_diff(results[("qwen3", "pp2")]["logprobs"], refs["qwen3"]) < tolerance
    assert min(refs["bf16 noise"]["broken_layer_shift"]) > tolerance
