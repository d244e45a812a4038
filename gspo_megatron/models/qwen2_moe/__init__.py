"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with a q/k/v bias (``qkv_bias``, default
true), softmax top-k routing without renormalization unless ``norm_topk_prob``, a shared expert
(``shared_expert_intermediate_size``) scaled by a sigmoid gate ``shared_expert_gate`` [1, hidden],
``decoder_sparse_step`` / ``mlp_only_layers`` dense layers. Megatron-Core: ``SharedExpertMLP`` with
``moe_shared_expert_gate`` computes sigmoid(x @ gate_weight^T) * shared_mlp(x), as transformers does."""

from gspo_megatron.models.family import GQAFamily
from gspo_megatron.models.registry import register_family
from gspo_megatron.models.rules import ExpertNaming


@register_family
class Qwen2Moe(GQAFamily):
    name = "qwen2_moe"
    architectures = ("Qwen2MoeForCausalLM",)
    sglang_modules = {"Qwen2MoeForCausalLM": "qwen2_moe"}
    hf_router_classes = ("Qwen2MoeTopKRouter",)
    sglang_every_layer_sparse = True  # sglang's qwen2_moe.py ignores mlp_only_layers / decoder_sparse_step
    expert_naming = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj")
    shared_expert_block = "mlp.shared_expert"
    shared_expert_gate = "mlp.shared_expert_gate.weight"
    fp8_excluded = GQAFamily.fp8_excluded + ("shared_expert_gate",)
    tiny = dict(
        architectures=["Qwen2MoeForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )

    def has_qkv_bias(self, hf: dict) -> bool:
        return bool(hf.get("qkv_bias", True))  # 4.x configs have no key: always biased

    def check(self, hf: dict) -> None:
        super().check(hf)
        if hf.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window is true; sliding-window attention is not supported")
