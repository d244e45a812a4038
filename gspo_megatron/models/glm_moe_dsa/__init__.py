"""GLM-5 (HF ``model_type`` glm_moe_dsa, ``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's architecture
(``deepseek_v32/``, inherited: MLA with ``q_lora_rank``, the sigmoid router with correction bias,
shared experts, dense first layers, DeepSeek Sparse Attention in every layer) with two differences in
transformers 5.23 (``models/glm_moe_dsa/modeling_glm_moe_dsa.py`` against ``deepseek_v32``'s):

- the indexer's RoPE is interleaved (``apply_rotary_pos_emb_interleave``: pairs (x0, x1), ... rotated
  and laid out de-interleaved before the scores): ``indexer.InterleavedLightningIndexer``;
- ``indexer_types``: a layer is ``"full"`` (its own indexer) or ``"shared"`` (no indexer; it reuses the
  previous full layer's top-k). transformers' default (``index_topk_freq`` 1) makes every layer full,
  as GLM-5's published config; ``"shared"`` layers (a selection carried from layer to layer, and
  across pipeline stages) are refused in ``check()`` naming the field.

The same tie rule and layouts as DeepSeek-V3.2 (``deepseek_v32/indexer.py``). sglang 0.5.23 serves it
with ``GlmMoeDsaForCausalLM`` (``models/glm4_moe.py``: a ``DeepseekV2ForCausalLM`` subclass, the same
loader, ``deepseek_common/deepseek_weight_loader.py``) and its MTP layer with ``GlmMoeDsaForCausalLMNextN``.
"""

from __future__ import annotations

from gspo_megatron.models.deepseek_v32 import DeepseekV32
from gspo_megatron.models.registry import register_family


def indexer_types(hf: dict) -> list[str]:
    """Per-layer ``"full"`` / ``"shared"``: config.json's ``indexer_types``, else transformers 5.23's
    ``GlmMoeDsaConfig.__post_init__`` rule (``index_topk_pattern`` "F"/"S", else ``index_topk_freq`` f and
    ``index_skip_topk_offset`` o: layer i is full when max(i - o + 1, 0) % f == 0)."""
    n = int(hf["num_hidden_layers"])
    if hf.get("indexer_types") is not None:
        return list(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(int(hf.get("index_topk_freq", 1)), 1), int(hf.get("index_skip_topk_offset", 2))
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


@register_family
class GlmMoeDsa(DeepseekV32):
    name = "glm_moe_dsa"
    architectures = ("GlmMoeDsaForCausalLM",)
    tiny = dict(DeepseekV32.tiny, architectures=["GlmMoeDsaForCausalLM"])
    published = {
        "glm-5": {  # zai-org/GLM-5: transformers 5.23's GlmMoeDsaConfig defaults (its docstring checkpoint)
            "architectures": ["GlmMoeDsaForCausalLM"],
            "model_type": "glm_moe_dsa",
            "vocab_size": 154880,
            "hidden_size": 6144,
            "intermediate_size": 12288,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 78,
            "num_attention_heads": 64,
            "num_key_value_heads": 64,
            "n_shared_experts": 1,
            "n_routed_experts": 256,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 512,
            "q_lora_rank": 2048,
            "qk_rope_head_dim": 64,
            "v_head_dim": 256,
            "qk_nope_head_dim": 192,
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "hidden_act": "silu",
            "max_position_embeddings": 202752,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "first_k_dense_replace": 3,
            "index_topk": 2048,
            "index_head_dim": 128,
            "index_n_heads": 32,
            "num_nextn_predict_layers": 1,
            "rope_theta": 1000000.0,
            "torch_dtype": "bfloat16",
            "moe_layer_freq": 1,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        },
    }

    def check(self, hf: dict) -> None:
        super().check(hf)
        types = indexer_types(hf)
        if len(types) != int(hf["num_hidden_layers"]) or set(types) - {"full", "shared"}:
            raise ValueError(
                f"config.json indexer_types {types} must give 'full' or 'shared' for each of the "
                f"{hf['num_hidden_layers']} layers ({self.name})"
            )
        if "shared" in types:
            raise ValueError(
                f"config.json indexer_types (or index_topk_freq / index_topk_pattern) gives 'shared' "
                f"layers {[i for i, t in enumerate(types) if t == 'shared']}: not supported for "
                f"{self.name} (every layer must run its own indexer, 'full')"
            )

    def adapt_layer_spec(self, block_spec, te: bool) -> None:
        from gspo_megatron.models.deepseek_v3 import DeepseekV3
        from gspo_megatron.models.deepseek_v32.indexer import InterleavedDSALocalAttention, use_dsa_attention

        DeepseekV3.adapt_layer_spec(self, block_spec, te)
        use_dsa_attention(block_spec, InterleavedDSALocalAttention)
