"""Qwen2 / Qwen2.5 dense: GQA with a bias on q/k/v (not on o_proj), often tied embeddings."""

from gspo_megatron.models.family import GQAFamily
from gspo_megatron.models.registry import register_family


@register_family
class Qwen2(GQAFamily):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    sglang_modules = {"Qwen2ForCausalLM": "qwen2"}
    sglang_ties_lm_head = True  # sglang's qwen2.py: lm_head = embed_tokens when tied
    qkv_bias = True
    tiny = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )

    def check(self, hf: dict) -> None:
        super().check(hf)
        if hf.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window is true; sliding-window attention is not supported")
