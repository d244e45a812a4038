"""Qwen3 dense: GQA with QK-norm (RMSNorm over each head before RoPE), no q/k/v bias."""

from gspo_megatron.models.family import GQAFamily
from gspo_megatron.models.registry import register_family


@register_family
class Qwen3(GQAFamily):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    sglang_modules = {"Qwen3ForCausalLM": "qwen3"}
    sglang_ties_lm_head = True  # sglang's qwen3.py: lm_head = embed_tokens when tied
    qk_norm = True
    tiny = dict(
        architectures=["Qwen3ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )

    def check(self, hf: dict) -> None:
        super().check(hf)
        if hf.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window is true; sliding-window attention is not supported")
