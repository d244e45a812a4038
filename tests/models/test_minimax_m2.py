"""minimax_m2 family pieces the shared family tests cannot show on their own.

- Each feature of the tiny model changes transformers' own output (so equal log-probs in
  test_equivalence / test_family_training_parity prove Megatron computes it): the correction bias, the
  q/k norm over ALL heads (a per-head norm gives other log-probs), partial rotary.
- ``FullWidthRMSNorm`` (models/minimax_m2/qk_norm.py) in TP2 on gloo: output, input gradient and the
  weight gradient of each rank's slice equal transformers' ``MiniMaxM2RMSNorm`` on the whole vector.
- Packed sequences of mixed lengths (4..61 tokens, THD on the local spec) through the trainer's code on
  one rank, TP2 and EP2: the packed scorer's log-probs equal transformers' forward within 1e-4, and
  packed == padded (log-probs, loss, gradients within 1e-5).
- The Megatron config and spec, the published config's spellings (``rotary_dim``, 4.x ``rope_theta``),
  and sglang_errors for the flags sglang reads but transformers ignores.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.models import get_family
from hf_reference import hf_logprobs, max_abs_diff
from tiny_models import tiny_hf_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pipeline"))
from packing_workers import make_records, packed_vs_padded_1_rank_tp2_ep2

FAMILY = get_family({"model_type": "minimax_m2"})
IDS = list(range(3, 40))
_cfg = partial(tiny_hf_config, "minimax_m2")


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


@pytest.fixture(scope="module")
def tiny(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("minimax_m2", seed=11)


def test_correction_bias_changes_the_expert_choice(tiny):
    import copy

    model = copy.deepcopy(tiny[1])
    ref = _logits(model)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert b.abs().max() > 0.1, name
            b.zero_()
    assert (ref - _logits(model)).abs().max() > 1e-3


def test_full_width_qk_norm_differs_from_a_per_head_norm(tiny):
    """The same weights with the statistic taken per head (Megatron's qk_layernorm) change the output."""
    import types

    model, head_dim = tiny[1], FAMILY.tiny["head_dim"]
    ref = _logits(model)

    def per_head(self, x):
        h = x.float().unflatten(-1, (-1, head_dim))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.flatten(-2).to(x.dtype)

    norms = [n for layer in model.model.layers for n in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    assert norms[0].weight.shape[0] == FAMILY.tiny["num_attention_heads"] * head_dim
    assert norms[1].weight.shape[0] == FAMILY.tiny["num_key_value_heads"] * head_dim
    for n in norms:
        n.forward = types.MethodType(per_head, n)
    try:
        assert (ref - _logits(model)).abs().max() > 1e-3
    finally:
        for n in norms:
            del n.forward
    assert torch.equal(ref, _logits(model))


def test_partial_rotary_changes_the_output(tiny):
    from gspo_megatron.models.tiny import hf_model_from_config

    full = hf_model_from_config(_cfg(rotary_dim=FAMILY.tiny["head_dim"]))
    full.load_state_dict(tiny[1].state_dict())
    assert full.config.rope_parameters["partial_rotary_factor"] == 1.0
    assert tiny[1].config.rope_parameters["partial_rotary_factor"] == 0.5
    assert (_logits(tiny[1]) - _logits(full)).abs().max() > 1e-3


# -- the TP norm against transformers' norm ------------------------------------------------------------


def _norm_tp(rank: int, world: int, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, heads: int) -> dict:
    """Rank's slice of FullWidthRMSNorm: forward, backward; returns its output and gradients."""
    from types import SimpleNamespace

    from gspo_megatron.models.minimax_m2.qk_norm import FullWidthRMSNorm
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(tp=world))
    hd = x.shape[-1] // heads
    cfg = SimpleNamespace(
        num_attention_heads=heads, num_query_groups=heads, tensor_model_parallel_size=world, params_dtype=torch.float32
    )
    norm = FullWidthRMSNorm(cfg, hd, eps=1e-6, which="q")
    with torch.no_grad():
        norm.weight.copy_(w.chunk(world)[rank])
    xs = x.unflatten(-1, (heads, hd)).chunk(world, dim=-2)[rank].clone().requires_grad_(True)
    y = norm(xs)
    y.backward(dy.unflatten(-1, (heads, hd)).chunk(world, dim=-2)[rank])
    out = dict(
        y=y.detach().flatten(-2),
        dx=xs.grad.flatten(-2),
        dw=norm.weight.grad.clone(),
        tp=bool(norm.weight.tensor_model_parallel),
        sp=hasattr(norm.weight, "sequence_parallel"),
    )
    destroy_distributed()
    return out


def test_full_width_norm_in_tp2_equals_transformers_norm():
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    g = torch.Generator().manual_seed(0)
    heads, hd = 4, 8
    x, dy = torch.randn(5, 2, heads * hd, generator=g) * 3, torch.randn(5, 2, heads * hd, generator=g)
    w = torch.randn(heads * hd, generator=g)
    ref = MiniMaxM2RMSNorm(heads * hd, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(w)
    xr = x.clone().requires_grad_(True)
    y = ref(xr)
    y.backward(dy)
    ranks = run_ranks(_norm_tp, 2, x, w, dy, heads)
    torch.testing.assert_close(torch.cat([r["y"] for r in ranks], -1), y.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat([r["dx"] for r in ranks], -1), xr.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(torch.cat([r["dw"] for r in ranks]), ref.weight.grad, atol=1e-5, rtol=1e-6)
    assert all(r["tp"] and not r["sp"] for r in ranks)  # TP-split weight; no sequence-parallel TP sum


# -- packed sequences --------------------------------------------------------------------------------


def test_packed_mixed_lengths_equal_transformers_in_1_rank_tp2_ep2(tiny):
    hf_dir, model = tiny
    rows = [r.tokens for r in make_records()]
    assert min(map(len, rows)) <= 5 and max(map(len, rows)) >= 60
    ref = hf_logprobs(model.float(), rows)
    results = packed_vs_padded_1_rank_tp2_ep2(hf_dir, 64)
    for name, per_rank in results.items():
        scored = [e["score"] for e in per_rank if "score" in e]
        assert len(scored) == 1, name
        padded, packed = scored[0]
        assert max_abs_diff(packed, ref) < 1e-4, name  # packed THD rows against transformers, row by row
        assert max_abs_diff(padded, ref) < 1e-4, name
        for e in per_rank:
            assert e["finite"] and e["grad_max"] > 1e-4, name
            assert e["grad_diff"] <= 1e-5, (name, e["grad_diff"])
            assert e["packed"]["loss"] == pytest.approx(e["padded"]["loss"], abs=1e-5, rel=1e-5), name


# -- config, spec, refusals -----------------------------------------------------------------------------


def test_megatron_config_and_spec():
    from gspo_megatron.models.minimax_m2.qk_norm import FullWidthRMSNorm, use_full_width_qk_norm

    f = FAMILY.config_fields(_cfg())
    assert f["qk_layernorm"] is False  # Megatron's per-head norm (and its by-name TP grad sum) stays off
    assert f["moe_router_score_function"] == "sigmoid" and f["moe_router_enable_expert_bias"]
    assert f["moe_router_bias_update_rate"] == 0.0 and f["moe_router_topk_scaling_factor"] == 1.0
    assert f["moe_ffn_hidden_size"] == 32 and f["moe_layer_freq"] == 1 and f["num_moe_experts"] == 8
    assert "moe_shared_expert_intermediate_size" not in f
    assert FAMILY.rotary_kwargs(_cfg())["rotary_percent"] == 0.5

    class Layer:  # the shape of a decoder block spec that use_full_width_qk_norm edits
        def __init__(self):
            attn = type("S", (), {"submodules": type("A", (), {"q_layernorm": None, "k_layernorm": None})()})()
            self.submodules = type("L", (), {"self_attention": attn})()

    spec = type("B", (), {"layer_specs": [Layer(), Layer()]})()
    assert use_full_width_qk_norm(spec) == 2
    sub = spec.layer_specs[1].submodules.self_attention.submodules
    assert sub.q_layernorm.module is FullWidthRMSNorm and sub.q_layernorm.params == {"which": "q"}
    assert sub.k_layernorm.params == {"which": "k"}


def test_published_config_reads_rotary_dim_and_counts_the_model():
    from gspo_megatron.models import hf_config
    from gspo_megatron.models.dims import ModelDims

    hf = FAMILY.published["minimax-m2"]
    assert "partial_rotary_factor" not in hf and "rope_parameters" not in hf  # rotary_dim, 4.x rope_theta
    assert hf_config.partial_rotary_factor(hf) == 0.5 and hf_config.rope_theta(hf) == 5e6
    assert FAMILY.rotary_kwargs(hf)["rotary_percent"] == 0.5
    d = ModelDims.from_hf_config(hf)
    assert (d.num_experts, d.topk, d.moe_ffn_hidden, d.moe_layers, d.shared_expert_ffn) == (
        256,
        8,
        1536,
        tuple(range(62)),
        0,
    )
    assert d.qk_norm and d.qk_norm_full_width
    assert FAMILY.sglang_errors(hf) == []
    FAMILY.check(hf)


@pytest.mark.parametrize(
    "override,field",
    [
        (dict(use_qk_norm=False), "use_qk_norm=False"),
        (dict(use_routing_bias=None), "use_routing_bias=None"),
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (dict(rotary_dim=None, partial_rotary_factor=0.5), "rotary_dim: 8"),
    ],
)
def test_sglang_errors_name_the_flag_sglang_reads(override, field):
    lines = FAMILY.sglang_errors(_cfg(**override))
    assert len(lines) == 1 and field in lines[0] and "\n" not in lines[0], lines


def test_linear_attention_layers_are_refused():
    with pytest.raises(ValueError, match="attn_type_list") as e:
        FAMILY.config_fields(_cfg(attn_type_list=[1, 0, 1, 1]))
    assert "\n" not in str(e.value)
