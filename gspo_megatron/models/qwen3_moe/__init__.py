"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with QK-norm, softmax top-k routing with
optional renormalization (norm_topk_prob), decoder_sparse_step / mlp_only_layers, no shared expert."""

from gspo_megatron.models.family import ModelFamily, common_config_fields, moe_layer_pattern, register


def config_fields(hf: dict) -> dict:
    fields = common_config_fields(hf)
    fields.update(
        qk_layernorm=True,
        num_moe_experts=hf.get("num_experts") or hf["num_local_experts"],  # v5 writes the latter
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        # top-k of the logits then softmax == softmax, top-k, renormalize (norm_topk_prob=True)
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        moe_layer_freq=moe_layer_pattern(hf),
        add_qkv_bias=bool(hf.get("attention_bias", False)),
    )
    return fields


QWEN3_MOE = register(ModelFamily(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    config_fields=config_fields,
    router_hf="mlp.gate.weight",
    expert_hf=("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight",
               "mlp.experts.*.down_proj.weight"),
    qk_norm=True,
))
