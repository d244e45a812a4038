"""Mixtral (8x7B, 8x22B): GQA, softmax over the top-k router logits (renormalized), w1/w3/w2
experts under ``block_sparse_moe``, expert size = ``intermediate_size``, no dense layers."""

from gspo_megatron.models import hf_config
from gspo_megatron.models.family import GQAFamily
from gspo_megatron.models.registry import register_family
from gspo_megatron.models.rules import ExpertNaming


@register_family
class Mixtral(GQAFamily):
    name = "mixtral"
    architectures = ("MixtralForCausalLM",)
    sglang_modules = {"MixtralForCausalLM": "mixtral"}
    hf_router_classes = ("MixtralTopKRouter",)
    expert_naming = ExpertNaming("block_sparse_moe", "w1", "w3", "w2")
    fp8_modules = GQAFamily.fp8_modules + ("w1", "w2", "w3")
    tiny = dict(
        architectures=["MixtralForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        sliding_window=None,
    )
    published = {
        "mixtral-8x7b": {  # mistralai/Mixtral-8x7B-v0.1
            "architectures": ["MixtralForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "initializer_range": 0.02,
            "intermediate_size": 14336,
            "max_position_embeddings": 32768,
            "model_type": "mixtral",
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.02,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "vocab_size": 32000,
        },
    }

    def check(self, hf: dict) -> None:
        super().check(hf)
        if hf.get("sliding_window"):
            raise ValueError("config.json sliding_window is set; sliding-window attention is not supported")

    def moe_ffn_hidden(self, hf: dict) -> int:
        return hf_config.get_int(hf, "intermediate_size")

    def moe_fields(self, hf: dict) -> dict:
        fields = super().moe_fields(hf)
        fields.update(moe_router_pre_softmax=False, moe_layer_freq=1)  # always renormalized top-k
        return fields
