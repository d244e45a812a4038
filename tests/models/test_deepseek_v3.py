"""deepseek_v3 family pieces the equivalence test cannot show on its own: the correction bias really
steers transformers' routing (so matching log-probs prove it is loaded), what is refused (one line
naming the field), the planner's counts for multi-latent attention, and the Megatron config."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from gspo_megatron.models import get_family
from gspo_megatron.models.dims import ModelDims
from gspo_megatron.planner import layer_params, param_counts
from tiny_models import tiny_hf_config

FAMILY = get_family({"model_type": "deepseek_v3"})
_cfg = partial(tiny_hf_config, "deepseek_v3")


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_correction_bias_changes_the_expert_choice(tmp_path):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    model = save_tiny_hf_model("deepseek_v3", str(tmp_path), seed=11)
    ids = list(range(3, 40))
    with_bias = _hf_logits(model, ids)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            assert b.abs().max() > 0.1, name  # the tiny model's bias is random, not zero
            b.zero_()
    assert (with_bias - _hf_logits(model, ids)).abs().max() > 1e-3


@pytest.mark.parametrize(
    "override,field",
    [
        (dict(norm_topk_prob=False), "norm_topk_prob=false"),
        (dict(topk_group=1), "num_experts_per_tok=4 // topk_group=1 != 2"),
        (
            dict(
                rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=128, attention_factor=1.2)
            ),
            "attention_factor",
        ),
        (dict(rope_scaling=dict(type="llama3", factor=8.0)), "rope type 'llama3'"),
        (dict(attention_bias=True), "attention_bias=true"),
    ],
)
def test_refused_features_name_the_field(override, field):
    with pytest.raises(ValueError, match="config.json .*is not supported for deepseek_v3") as e:
        FAMILY.config_fields(_cfg(**override))
    assert field in str(e.value)
    assert "\n" not in str(e.value)


def test_both_layer_specs_are_accepted():
    # TE's MLA layout (duplicated down projections, fused norms): tests/models/test_deepseek_v3_te.py
    FAMILY.check_transformer_impl(te=True)
    FAMILY.check_transformer_impl(te=False)


def test_no_group_limit_when_every_group_is_kept():
    fields = FAMILY.config_fields(_cfg(n_group=4, topk_group=4, num_experts_per_tok=3))
    assert fields["moe_router_num_groups"] is None and fields["moe_router_group_topk"] is None


def test_megatron_config_fields():
    f = FAMILY.config_fields(_cfg())
    assert FAMILY.megatron_config_class().__name__ == "MLATransformerConfig"
    assert (f["q_lora_rank"], f["kv_lora_rank"], f["qk_head_dim"], f["qk_pos_emb_head_dim"], f["v_head_dim"]) == (
        32,
        32,
        16,
        8,
        16,
    )
    assert f["moe_layer_freq"] == [0, 1, 1, 1]  # first_k_dense_replace=1
    assert f["moe_router_score_function"] == "sigmoid" and f["moe_router_enable_expert_bias"]
    assert f["moe_router_bias_update_rate"] == 0.0  # the correction bias stays the checkpoint's
    assert f["moe_router_topk_scaling_factor"] == 2.5 and f["moe_shared_expert_intermediate_size"] == 32
    assert (f["rope_type"], f["rotary_scaling_factor"], f["mscale"], f["mscale_all_dim"]) == ("yarn", 4.0, 1.0, 1.0)
    plain = FAMILY.config_fields(_cfg(rope_scaling=None, q_lora_rank=None))
    assert plain["rope_type"] == "rope" and plain["rotary_scaling_factor"] == 1.0 and plain["q_lora_rank"] is None


@pytest.mark.parametrize("override", [{}, dict(q_lora_rank=None, n_shared_experts=2)])
def test_planner_counts_equal_transformers_parameters(override):
    from gspo_megatron.models.tiny import hf_model_from_config

    cfg = _cfg(**override)
    model = hf_model_from_config(cfg)
    d = ModelDims.from_hf_config(cfg)
    c = param_counts(d)
    named = dict(model.named_parameters())
    assert c.total == sum(p.numel() for p in named.values())
    assert c.expert == sum(p.numel() for n, p in named.items() if ".mlp.experts." in n)
    assert d.moe_layers == (1, 2, 3) and layer_params(d, 0).expert == 0


@pytest.mark.parametrize("override", [{}, dict(q_lora_rank=None)])
def test_planner_counts_te_down_projections_replicated(override):
    """On Transformer Engine's spec MLA's down projections are whole on every TP rank (TELinear
    "duplicated"; tests/models/test_deepseek_v3_te.py): the planner moves exactly their parameters,
    read from transformers' model, from the TP-sharded count to the replicated one; totals unchanged."""
    from gspo_megatron.models.tiny import hf_model_from_config

    cfg = _cfg(**override)
    named = dict(hf_model_from_config(cfg).named_parameters())
    down = sum(
        named[f"model.layers.0.self_attn.{m}.weight"].numel()
        for m in ("q_a_proj", "kv_a_proj_with_mqa")
        if f"model.layers.0.self_attn.{m}.weight" in named
    )
    d = ModelDims.from_hf_config(cfg)
    local, te = layer_params(d, 0), layer_params(d, 0, te=True)
    assert te.replicated - local.replicated == down == local.tp_sharded - te.tp_sharded > 0
