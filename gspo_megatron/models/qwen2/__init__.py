"""Qwen2 / Qwen2.5 dense: GQA with a bias on q/k/v, often tied embeddings in the small sizes."""

from gspo_megatron.models.family import ModelFamily, common_config_fields, register


def config_fields(hf: dict) -> dict:
    if hf.get("use_sliding_window"):
        raise ValueError("config.json use_sliding_window is true; sliding-window attention is not supported")
    fields = common_config_fields(hf)
    fields.update(add_qkv_bias=True)
    return fields


QWEN2 = register(ModelFamily(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    config_fields=config_fields,
))
