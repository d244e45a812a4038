"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with QK-norm, no q/k/v bias, softmax top-k
routing with optional renormalization (``norm_topk_prob``), ``decoder_sparse_step`` /
``mlp_only_layers``, no shared expert. transformers 5.x saves ``num_local_experts`` and
``rope_parameters`` where 4.x wrote ``num_experts`` and ``rope_theta``; both are read."""

from gspo_megatron.models.family import GQAFamily
from gspo_megatron.models.registry import register_family
from gspo_megatron.models.rules import ExpertNaming


def _published(hidden: int, ffn: int, moe_ffn: int, heads: int, layers: int) -> dict:
    # Published config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (they differ only in these).
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": ffn,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": moe_ffn,
        "norm_topk_prob": True,
        "num_attention_heads": heads,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": layers,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


@register_family
class Qwen3Moe(GQAFamily):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    sglang_modules = {"Qwen3MoeForCausalLM": "qwen3_moe"}
    hf_router_classes = ("Qwen3MoeTopKRouter",)
    sglang_every_layer_sparse = True  # sglang's qwen3_moe.py ignores mlp_only_layers / decoder_sparse_step
    qk_norm = True
    expert_naming = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj")
    tiny = dict(
        architectures=["Qwen3MoeForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    published = {
        "qwen3-30b-a3b": _published(hidden=2048, ffn=6144, moe_ffn=768, heads=32, layers=48),
        "qwen3-235b-a22b": _published(hidden=4096, ffn=12288, moe_ffn=1536, heads=64, layers=94),
        "tiny-qwen3-moe": {  # the CPU demo: byte tokenizer (259 ids) padded to 320
            "architectures": ["Qwen3MoeForCausalLM"],
            "attention_bias": False,
            "decoder_sparse_step": 1,
            "head_dim": 16,
            "hidden_act": "silu",
            "hidden_size": 64,
            "initializer_range": 0.02,
            "intermediate_size": 128,
            "max_position_embeddings": 512,
            "mlp_only_layers": [],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "num_attention_heads": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.0,
            "tie_word_embeddings": False,
            "vocab_size": 320,
            "pad_token_id": 256,
            "eos_token_id": 258,
        },
    }
