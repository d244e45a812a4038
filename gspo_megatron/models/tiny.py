"""Tiny random Hugging Face models built with transformers' own classes (tests and the CPU demo).

``save_tiny_hf_model(arch, out_dir, seed=0, **overrides)`` writes config.json + model.safetensors
(+ generation_config.json) exactly as ``save_pretrained`` does, so every conversion test starts from a
checkpoint transformers itself wrote.
"""

from __future__ import annotations

import torch

TINY_CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=False,
        decoder_sparse_step=1, mlp_only_layers=[]),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=1e6,
        max_position_embeddings=512, tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
        use_sliding_window=False),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=False),
}

_CLASSES = {
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("MixtralConfig", "MixtralForCausalLM"),
    "Qwen2ForCausalLM": ("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def hf_model_from_config(cfg: dict, dtype: torch.dtype = torch.float32):
    """A randomly initialized transformers model for an HF config dict."""
    import transformers

    arch = cfg["architectures"][0]
    cfg_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[arch])
    kwargs = {k: v for k, v in cfg.items() if k != "architectures"}
    config = cfg_cls(**kwargs)
    config.architectures = [arch]
    return model_cls(config).to(dtype)


def save_tiny_hf_model(kind: str, out_dir: str, seed: int = 0, dtype=torch.float32, **overrides):
    """Build a tiny random ``kind`` model (a key of TINY_CONFIGS) and ``save_pretrained`` it.
    Router and norm weights are randomized too, so routing and norms are exercised."""
    cfg = dict(TINY_CONFIGS[kind])
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = hf_model_from_config(cfg, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".gate." in name or name.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(out_dir)
    return model
