"""gpt_oss family pieces the equivalence test cannot show on its own: every feature of the tiny model
really changes transformers' output (so matching log-probs in test_equivalence.py prove Megatron
computes it: sinks, sliding window, YaRN, the SwiGLU clamp, router and expert biases), what is
refused (one line naming the field), the Megatron config, the stacked-expert rules both ways, and the
planner's counts."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from gspo_megatron.models import get_family
from gspo_megatron.models.dims import ModelDims
from gspo_megatron.planner import param_counts
from tiny_models import tiny_hf_config

FAMILY = get_family({"model_type": "gpt_oss"})
ROWS = [list(range(3, 26)), [7, 1, 9, 200, 45, 3, 3, 18, 90, 11, 4, 5, 6]]
_cfg = partial(tiny_hf_config, "gpt_oss")


@torch.no_grad()
def _logprobs(model) -> torch.Tensor:
    out = []
    for ids in ROWS:
        t = torch.tensor([ids])
        out.append(torch.log_softmax(model(t).logits[0, :-1].float(), -1).gather(1, t[0, 1:, None]).squeeze(1))
    return torch.cat(out)


@pytest.fixture(scope="module")
def tiny(tiny_hf_checkpoint):
    _, model = tiny_hf_checkpoint("gpt_oss", seed=11)
    return model.eval(), _logprobs(model)


def _changed(model, ref) -> float:
    return (_logprobs(model) - ref).abs().max().item()


def _edit(model, suffix: str, fn):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(suffix):
                p.copy_(fn(p))
    return m


@pytest.mark.parametrize(
    "suffix",
    [
        "self_attn.sinks",
        "mlp.router.bias",
        "experts.gate_up_proj_bias",
        "experts.down_proj_bias",
        "self_attn.o_proj.bias",
        "self_attn.q_proj.bias",
    ],
)
def test_each_parameter_kind_matters(tiny, suffix):
    model, ref = tiny
    assert _changed(_edit(model, suffix, torch.zeros_like), ref) > 1e-3


@pytest.mark.parametrize("attr,value", [("sliding_window", 1000), ("swiglu_limit", 1000.0)])
def test_sliding_window_and_clamp_are_active(tiny, attr, value):
    """A window longer than the rows, or a limit the activations never reach, changes the output: the
    tiny model's window (4) and clamp (0.1) act on these rows."""
    model, ref = tiny
    m = copy.deepcopy(model)
    setattr(m.config, attr, value)
    for layer in m.model.layers:
        if attr == "sliding_window" and layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = value
        if attr == "swiglu_limit":
            layer.mlp.experts.limit = value
    assert _changed(m, ref) > 1e-3


def test_yarn_is_active(tmp_path):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    yarn = save_tiny_hf_model("gpt_oss", str(tmp_path / "a"), seed=11)
    plain = save_tiny_hf_model("gpt_oss", str(tmp_path / "b"), seed=11, rope_scaling=None)
    plain.load_state_dict(yarn.state_dict())
    assert (_logprobs(yarn) - _logprobs(plain)).abs().max() > 1e-3


@pytest.mark.parametrize(
    "override,field",
    [
        (dict(attention_bias=False), "attention_bias=false"),
        (dict(quantization_config={"quant_method": "mxfp4"}), "quantization_config"),
        (dict(layer_types=["chunked_attention"] * 4), "layer_types"),
        (dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "rope type 'llama3'"),
        (dict(rope_scaling=dict(rope_type="yarn", factor=1.0, attention_factor=1.5)), "attention_factor"),
    ],
)
def test_refused_features_name_the_field(override, field):
    with pytest.raises(ValueError, match="config.json .*is not supported for gpt_oss") as e:
        FAMILY.config_fields(_cfg(**override))
    assert field in str(e.value) and "\n" not in str(e.value)


def test_transformer_engine_spec_is_refused_not_mismapped():
    with pytest.raises(ValueError, match="model.transformer_impl=local"):
        FAMILY.check_transformer_impl(te=True)
    FAMILY.check_transformer_impl(te=False)


def test_megatron_config_fields():
    from megatron.core.activations import quick_gelu

    f = FAMILY.config_fields(_cfg())
    assert f["window_size"] == (3, 0)  # transformers: i - 4 < j <= i  ->  Megatron: i - 3 <= j <= i + 0
    assert f["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert f["softmax_type"] == "learnable" and f["add_bias_linear"] and f["add_qkv_bias"]
    assert f["activation_func"] is quick_gelu and f["glu_linear_offset"] == 1.0
    assert f["activation_func_clamp_value"] == 0.1 and not f["bias_activation_fusion"]
    assert not f["moe_router_pre_softmax"] and f["num_moe_experts"] == 4 and f["moe_ffn_hidden_size"] == 32
    assert (f["yarn_rotary_scaling_factor"], f["yarn_original_max_position_embeddings"]) == (32.0, 16)
    assert f["yarn_correction_range_round_to_int"] is False  # truncate=false
    assert f["yarn_mscale"] is None  # attention factor: get_mscale(factor), as transformers
    assert FAMILY.rotary_kwargs(_cfg())["position_embedding_type"] == "yarn"
    other = FAMILY.config_fields(_cfg(swiglu_alpha=1.5))["activation_func"]
    x = torch.linspace(-3, 3, 7)
    assert torch.equal(other(x), x * torch.sigmoid(1.5 * x))
    default_types = FAMILY.config_fields(_cfg(layer_types=None))
    assert default_types["window_attn_skip_freq"] == [1, 0, 1, 0]  # transformers' default pattern


def test_stacked_expert_rules_round_trip_exactly():
    """One expert's row of the stacked HF tensors -> its Megatron fc1/fc2 (whole, and ETP-2 shards) ->
    back, bitwise."""
    rules = {
        r.megatron.split(".")[-2] + "." + r.megatron.split(".")[-1]: r
        for r in FAMILY.mapping(_cfg()).rules
        if r.stacked_experts
    }
    E, H, inter = 4, 6, 5
    g = torch.Generator().manual_seed(0)
    gate_up, gate_up_b = torch.randn(E, H, 2 * inter, generator=g), torch.randn(E, 2 * inter, generator=g)
    down = torch.randn(E, inter, H, generator=g)
    e = 2
    fc1 = rules["linear_fc1.weight"]
    assert fc1.expert_index("decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight") == e
    full = fc1.to_local([gate_up[e]], 0, 1)  # Megatron's [gate; up], each [I, H]: de-interleaved, transposed
    assert full.shape == (2 * inter, H)
    assert torch.equal(full[:inter], gate_up[e][:, 0::2].t()) and torch.equal(full[inter:], gate_up[e][:, 1::2].t())
    for rule, t in (
        (fc1, gate_up[e]),
        (rules["linear_fc1.bias"], gate_up_b[e]),
        (rules["linear_fc2.weight"], down[e]),
        (rules["linear_fc2.bias"], torch.randn(H, generator=g)),
    ):
        assert torch.equal(rule.from_shards([rule.to_local([t], 0, 1)])[0], t)
    # ETP 2 (even intermediate size): each rank's [gate_r; up_r] and fc2 columns, rebuilt exactly
    gate_up2, down2 = torch.randn(H, 8, generator=g), torch.randn(4, H, generator=g)
    for rule, t in ((fc1, gate_up2), (rules["linear_fc2.weight"], down2)):
        assert torch.equal(rule.from_shards([rule.to_local([t], r, 2) for r in range(2)])[0], t)


def test_planner_counts_equal_transformers_parameters(tiny):
    model, _ = tiny
    c = param_counts(ModelDims.from_hf_config(_cfg()))
    named = dict(model.named_parameters())
    assert c.total == sum(p.numel() for p in named.values())
    assert c.expert == sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)


def test_expert_tensor_parallel_above_one_is_refused_before_building():
    from gspo_megatron.models.build import check_layout

    with pytest.raises(ValueError, match=r"^parallel.etp=2: gpt_oss's expert biases need expert tensor parallel"):
        check_layout(_cfg(), tp=2, pp=1, ep=1, etp=None)
    check_layout(_cfg(), tp=2, pp=1, ep=2, etp=1)


def test_cpu_stand_in_server_shards_engine_tp_as_sglang_does():
    """sglang 0.5.23 serves gpt-oss at engine TP > 1 (stacked experts cut by FusedMoE, sinks by
    head); the CPU stand-in no longer refuses it (tests/rollout/test_sglang_loaders.py serves TP 2)."""
    from gspo_megatron.cpu_server.sharding import Layout, kind_of

    for tp, ep in ((1, 1), (2, 1), (2, 2), (4, 2)):
        Layout.from_config(_cfg(), tp_size=tp, ep_size=ep).check()
    assert kind_of("model.layers.0.mlp.experts.gate_up_proj") == "stacked"
    assert kind_of("model.layers.0.self_attn.sinks") == "column"
    assert kind_of("model.layers.0.self_attn.o_proj.bias") == "replicated"
