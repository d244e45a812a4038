"""qwen3_next family pieces the shared family tests cannot show on their own.

- The Gated DeltaNet kernels (models/qwen3_next/kernels.py): the chunked rule equals the token-by-token
  recurrence and transformers' own torch fallbacks (``torch_chunk_gated_delta_rule``,
  ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``); with ``cu_seqlens`` every segment equals
  that segment run alone, and a row run without the resets differs (so a leak would be seen).
- transformers' recurrent decode (the CPU engine's generation: one token at a time with its cache)
  gives the same log-probs as its full forward, hence as the trainer's chunked path.
- Each feature of the tiny model changes transformers' output (so equal log-probs in test_equivalence
  prove Megatron computes it): the layer mix, the attention output gate, zero-centered norms, partial
  rotary, the shared-expert gate.
- Packed sequences of mixed lengths (4..61 tokens, THD on the local spec) through the trainer's code on
  one rank, TP2 and EP2: the packed scorer's log-probs equal transformers' forward within 1e-4, and
  packed == padded (log-probs, loss, gradients within 1e-5).
- The Megatron config, the published config's spelling (``full_attention_interval``), the planner's
  count, the refusals and sglang_errors.
"""

from __future__ import annotations

import os
import sys
from functools import partial

import pytest
import torch

from gspo_megatron.models import get_family
from gspo_megatron.models.qwen3_next import kernels as K
from hf_reference import hf_logprobs, max_abs_diff
from tiny_models import tiny_hf_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "pipeline"))
from packing_workers import make_records, packed_vs_padded_1_rank_tp2_ep2

FAMILY = get_family({"model_type": "qwen3_next"})
IDS = list(range(3, 40))
_cfg = partial(tiny_hf_config, "qwen3_next")


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor([ids]), use_cache=False).logits


def _inputs(b=1, t=150, h=4, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, t, h, dk, generator=g), torch.randn(b, t, h, dk, generator=g)
    v = torch.randn(b, t, h, dv, generator=g)
    return q, k, v, -torch.rand(b, t, h, generator=g) * 0.3, torch.rand(b, t, h, generator=g)


@pytest.fixture(scope="module")
def tiny(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_next", seed=11)


# -- kernels ------------------------------------------------------------------------------------------


def test_chunked_rule_equals_recurrence_and_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    q, k, v, g, beta = _inputs(b=2)
    qn, kn = K.l2norm(q), K.l2norm(k)
    chunked = K.torch_chunk_gated_delta_rule(qn, kn, v, g, beta)
    assert chunked.shape == v.shape
    torch.testing.assert_close(chunked, K.recurrent_gated_delta_rule(qn, kn, v, g, beta), atol=2e-6, rtol=0)
    ref, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(chunked, ref, atol=2e-6, rtol=0)
    rec, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(chunked, rec, atol=2e-6, rtol=0)
    # gradients flow through the triangular solve and the chunk recursion
    qg = qn.clone().requires_grad_(True)
    K.torch_chunk_gated_delta_rule(qg, kn, v, g, beta).square().sum().backward()
    assert torch.isfinite(qg.grad).all() and qg.grad.abs().max() > 0


def test_causal_conv_equals_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 12, 40, generator=g), torch.randn(12, 4, generator=g)
    torch.testing.assert_close(
        K.causal_conv1d(x, w), hf.causal_conv1d_fn(x, w, None, activation="silu"), atol=1e-6, rtol=0
    )


def test_packed_segments_reset_state_and_convolution_exactly():
    q, k, v, g, beta = _inputs(t=157, seed=2)
    cu = [0, 5, 5, 70, 71, 157]  # an empty segment, a one-token one, one over two chunks
    q, k = K.l2norm(q), K.l2norm(k)
    packed = K.torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor(cu))
    alone = torch.cat(
        [
            K.torch_chunk_gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b])
            for a, b in zip(cu[:-1], cu[1:])
            if b > a
        ],
        dim=1,
    )
    assert torch.equal(packed, alone)
    torch.testing.assert_close(K.recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu), packed, atol=2e-6, rtol=0)
    leaked = K.torch_chunk_gated_delta_rule(q, k, v, g, beta)  # no resets: the state crosses the boundaries
    assert (leaked[:, 5:] - packed[:, 5:]).abs().max() > 1e-2
    x, w = torch.randn(1, 6, 157), torch.randn(6, 4)
    conv = K.causal_conv1d(x, w, cu_seqlens=cu)
    alone = torch.cat([K.causal_conv1d(x[..., a:b], w) for a, b in zip(cu[:-1], cu[1:]) if b > a], -1)
    torch.testing.assert_close(conv, alone, atol=1e-6, rtol=0)  # (SiLU's vector tail may round 1 ulp apart)
    assert (K.causal_conv1d(x, w)[..., 5:8] - conv[..., 5:8]).abs().max() > 1e-3


def test_transformers_recurrent_decode_equals_its_full_forward(tiny):
    """The CPU engine generates with transformers' model: prefill, then one token at a time through its
    recurrent state (``torch_recurrent_gated_delta_rule`` + ``causal_conv1d_update``). Its per-token
    log-probs equal the full (chunked) forward's, which test_equivalence equates to the trainer's."""
    model = tiny[1].float().eval()
    ids = torch.tensor([IDS])
    full = torch.log_softmax(_logits(model), -1)[0]
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        cache, steps = out.past_key_values, [torch.log_softmax(out.logits[0, -1], -1)]
        for t in range(5, len(IDS)):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(torch.log_softmax(out.logits[0, -1], -1))
    torch.testing.assert_close(torch.stack(steps), full[4:], atol=2e-5, rtol=0)


# -- features change transformers' output --------------------------------------------------------------


def test_each_feature_changes_the_output(tiny):
    import copy

    from gspo_megatron.models.tiny import hf_model_from_config

    model = tiny[1]
    ref = _logits(model)
    all_linear = hf_model_from_config(_cfg(layer_types=["linear_attention"] * 4))
    state = {k: v for k, v in model.state_dict().items() if "self_attn" not in k}
    assert (ref - _logits(_load(all_linear, state))).abs().max() > 1e-3  # the layer mix matters
    full_rotary = hf_model_from_config(_cfg(partial_rotary_factor=1.0))
    full_rotary.load_state_dict(model.state_dict())
    assert (ref - _logits(full_rotary)).abs().max() > 1e-3
    for pattern in ("q_proj", "shared_expert_gate", "input_layernorm", "linear_attn.norm", "conv1d", "dt_bias"):
        m = copy.deepcopy(model)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if pattern in name:
                    if pattern == "q_proj":  # the output-gate half of each head's rows: gate = 0 -> x / 2
                        p.view(4, 2, 16, -1)[:, 1].zero_()
                    else:
                        p.zero_()
        assert (ref - _logits(m)).abs().max() > 1e-3, pattern


def _load(model, state):
    missing = model.load_state_dict(state, strict=False)
    assert not [k for k in missing.unexpected_keys]
    return model


# -- packed sequences through the trainer --------------------------------------------------------------


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


# -- config, dims, refusals -----------------------------------------------------------------------------


def test_megatron_config():
    f = FAMILY.config_fields(_cfg())
    assert f["attention_output_gate"] and f["qk_layernorm"] and f["layernorm_zero_centered_gamma"]
    assert f["linear_attention_freq"] == [1, 0, 1, 0]
    assert (f["linear_num_key_heads"], f["linear_num_value_heads"], f["linear_key_head_dim"]) == (2, 4, 8)
    assert f["moe_shared_expert_gate"] and f["moe_shared_expert_intermediate_size"] == 24
    assert FAMILY.rotary_kwargs(_cfg())["rotary_percent"] == 0.25


def test_published_config_pattern_and_planner_count():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from gspo_megatron.models.dims import ModelDims
    from gspo_megatron.planner import param_counts

    hf = FAMILY.published["qwen3-next-80b-a3b"]
    d = ModelDims.from_hf_config(hf)
    assert d.linear_layers == tuple(i for i in range(48) if (i + 1) % 4)
    assert FAMILY.sglang_errors(hf) == []
    total = param_counts(d).total
    assert 79e9 < total < 82e9, total  # Qwen3-Next-80B-A3B
    # the tiny model's count equals transformers' (the published one is too big to build here)
    small = dict(
        hf,
        num_hidden_layers=4,
        num_experts=4,
        hidden_size=64,
        vocab_size=128,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        head_dim=16,
        num_attention_heads=4,
    )
    kw = {k: v for k, v in small.items() if k not in ("architectures", "model_type", "torch_dtype")}
    m = Qwen3NextForCausalLM(Qwen3NextConfig(**kw))
    assert param_counts(ModelDims.from_hf_config(small)).total == sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize(
    "override,field",
    [
        (
            dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
            "layer_types",
        ),
        (dict(linear_num_value_heads=3), "linear_num_value_heads"),
        (dict(rope_parameters=dict(rope_type="yarn", factor=2.0, rope_theta=1e4, partial_rotary_factor=0.25)), "rope"),
    ],
)
def test_refusals_name_the_field(override, field):
    with pytest.raises(ValueError, match=field) as e:
        FAMILY.config_fields(_cfg(**override))
    assert "\n" not in str(e.value)


def test_sglang_errors_name_layer_types_sglang_ignores():
    assert FAMILY.sglang_errors(_cfg(layer_types=None)) == []
    assert FAMILY.sglang_errors(_cfg()) == []  # layer_types [L, F, L, F] = every 2nd layer full
    lines = FAMILY.sglang_errors(_cfg(full_attention_interval=None))  # sglang's default: every 4th
    assert len(lines) == 1 and "layer_types" in lines[0] and "full_attention_interval" in lines[0]
