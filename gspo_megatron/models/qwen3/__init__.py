"""Qwen3 dense: GQA with QK-norm (RMSNorm over each head before RoPE), no q/k/v bias."""

from gspo_megatron.models.family import ModelFamily, common_config_fields, register


def config_fields(hf: dict) -> dict:
    fields = common_config_fields(hf)
    fields.update(qk_layernorm=True, add_qkv_bias=bool(hf.get("attention_bias", False)))
    return fields


QWEN3 = register(ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    config_fields=config_fields,
    qk_norm=True,
))
