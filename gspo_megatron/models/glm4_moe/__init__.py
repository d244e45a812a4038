"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (HF ``model_type`` glm4_moe): GQA with a bias on q/k/v
(``attention_bias``; o_proj has none), optional per-head QK-norm (``use_qk_norm``), partial rotary
(``partial_rotary_factor``, rotate-half on the first part of each head: Megatron's
``rotary_percent``), ``first_k_dense_replace`` dense first layers, ``n_shared_experts`` ungated
shared experts, and DeepSeek-V3's sigmoid router with the ``e_score_correction_bias`` (frozen, see
``family.sigmoid_router_fields``), group-limited top-k and ``routed_scaling_factor``.
The multi-token-prediction layers of the published checkpoints are not part of transformers' model:
not loaded."""

from gspo_megatron.models import hf_config
from gspo_megatron.models.family import GQAFamily, sigmoid_router_check, sigmoid_router_fields
from gspo_megatron.models.mapping import MappingRegistry
from gspo_megatron.models.registry import register_family
from gspo_megatron.models.rules import ExpertNaming, router_bias_rule


@register_family
class Glm4Moe(GQAFamily):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    sglang_modules = {"Glm4MoeForCausalLM": "glm4_moe"}
    sglang_draft_modules = {"Glm4MoeForCausalLMNextN": "glm4_moe_nextn"}
    mtp_trainable = True
    sglang_draft_path_defaulted = True  # in _handle_eagle_family's list (subclass families too)
    expert_naming = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj")
    shared_expert_block = "mlp.shared_experts"
    attention_bias_on_o_proj = False
    tiny = dict(
        architectures=["Glm4MoeForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )

    published = {
        "glm-4.5": {  # zai-org/GLM-4.5 (355B total, 32B active; GLM-4.6 has the same shapes)
            "architectures": ["Glm4MoeForCausalLM"],
            "attention_bias": True,
            "attention_dropout": 0.0,
            "pad_token_id": 151329,
            "eos_token_id": [151329, 151336, 151338],
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 5120,
            "partial_rotary_factor": 0.5,
            "initializer_range": 0.02,
            "intermediate_size": 12288,
            "max_position_embeddings": 131072,
            "model_type": "glm4_moe",
            "moe_intermediate_size": 1536,
            "norm_topk_prob": True,
            "num_attention_heads": 96,
            "n_group": 1,
            "topk_group": 1,
            "n_routed_experts": 160,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "num_hidden_layers": 92,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_scaling": None,
            "rope_theta": 1000000,
            "num_nextn_predict_layers": 1,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "use_qk_norm": True,
            "vocab_size": 151552,
        },
        # transformers' Glm4MoeConfig defaults, the shapes of GLM-4.5-Air (106B total, 12B active); listed so
        # that a directory named GLM-4.5-Air is not planned as GLM-4.5
        "glm-4.5-air": {
            "architectures": ["Glm4MoeForCausalLM"],
            "attention_bias": True,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "partial_rotary_factor": 0.5,
            "intermediate_size": 10944,
            "max_position_embeddings": 131072,
            "model_type": "glm4_moe",
            "moe_intermediate_size": 1408,
            "norm_topk_prob": True,
            "num_attention_heads": 96,
            "n_group": 1,
            "topk_group": 1,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "routed_scaling_factor": 1.0,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 1,
            "num_hidden_layers": 46,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_qk_norm": False,
            "vocab_size": 151552,
        },
    }

    def has_qk_norm(self, hf: dict) -> bool:
        return bool(hf.get("use_qk_norm", False))

    def check(self, hf: dict) -> None:
        super().check(hf)
        sigmoid_router_check(hf, self.name)
        if not int(hf.get("n_shared_experts") or 0):
            # transformers then keeps zero-width shared-expert tensors that Megatron has no place for
            raise ValueError(f"config.json n_shared_experts=0 is not supported for {self.name}")

    def shared_ffn_hidden(self, hf: dict) -> int:
        return hf_config.get_int(hf, "moe_intermediate_size") * int(hf.get("n_shared_experts") or 0)

    def moe_fields(self, hf: dict) -> dict:
        fields = super().moe_fields(hf)
        fields.update(sigmoid_router_fields(hf))
        return fields

    def mapping(self, hf: dict) -> MappingRegistry:
        registry = super().mapping(hf)
        registry.rules.append(router_bias_rule("mlp.gate.e_score_correction_bias"))
        return registry
