"""Mixtral (8x7B, 8x22B): GQA, softmax over the top-k router logits (renormalized), w1/w3/w2 experts."""

from gspo_megatron.models.family import ModelFamily, common_config_fields, register


def config_fields(hf: dict) -> dict:
    if hf.get("sliding_window"):
        raise ValueError("config.json sliding_window is set; sliding-window attention is not supported")
    fields = common_config_fields(hf)
    fields.update(
        num_moe_experts=hf["num_local_experts"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"],
        moe_router_pre_softmax=False,
    )
    return fields


MIXTRAL = register(ModelFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    config_fields=config_fields,
    router_hf="block_sparse_moe.gate.weight",
    expert_hf=("block_sparse_moe.experts.*.w1.weight", "block_sparse_moe.experts.*.w3.weight",
               "block_sparse_moe.experts.*.w2.weight"),
))
