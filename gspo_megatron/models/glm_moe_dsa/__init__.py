"""GLM-5 (HF ``model_type`` glm_moe_dsa, ``GlmMoeDsaForCausalLM``): DeepSeek-V3.2's architecture
(``deepseek_v32/``, inherited: MLA with ``q_lora_rank``, the sigmoid router with correction bias,
shared experts, dense first layers, DeepSeek Sparse Attention in every layer) with two differences in
transformers 5.23 (``models/glm_moe_dsa/modeling_glm_moe_dsa.py`` against ``deepseek_v32``'s):

- the indexer's RoPE is interleaved (``apply_rotary_pos_emb_interleave``: pairs (x0, x1), ... rotated
  and laid out de-interleaved before the scores): ``indexer.InterleavedLightningIndexer``;
- ``indexer_types``: a layer is ``"full"`` (its own indexer) or ``"shared"`` (no indexer, no indexer
  weights in the checkpoint; it reuses the top-k of the last full layer before it, ``skip_topk`` in
  transformers and sglang). transformers' default (``index_topk_freq`` 1) makes every layer full, as
  GLM-5's published config. Megatron side: ``config.dsa_indexer_types`` (``indexer.DSAMLAConfig``); a
  shared layer's core attention builds no indexer and takes the selection its full layer made in the
  same forward (``indexer.SelectionCarry``), so the mapping finds no indexer parameter to convert,
  export or sync there. Refused: a shared first layer (``check``), a pipeline stage starting on a
  shared layer (``check_layout``: the selection is not sent between stages) and ``model.recompute``
  (``indexer.shared_source``).

The same tie rule and layouts as DeepSeek-V3.2 (``deepseek_v32/indexer.py``). sglang 0.5.23 serves it
with ``GlmMoeDsaForCausalLM`` (``models/glm4_moe.py``: a ``DeepseekV2ForCausalLM`` subclass, the same
loader, ``deepseek_common/deepseek_weight_loader.py``) and its MTP layer with ``GlmMoeDsaForCausalLMNextN``.
"""

from __future__ import annotations

import dataclasses

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
    sglang_modules = {"GlmMoeDsaForCausalLM": "glm4_moe"}  # sglang's class: glm4_moe.py
    hf_router_classes = ("GlmMoeDsaTopkRouter",)  # (not perturbable: DeepseekV32's sigmoid router)
    hf_indexer_classes = ("GlmMoeDsaIndexer",)
    tiny = dict(DeepseekV32.tiny, architectures=["GlmMoeDsaForCausalLM"])
    # zai-org/GLM-5's config.json. The hub file is not reachable from here; each value names the public copies it
    # was checked against:
    #   g5: a full copy of GLM-5's config.json in a public Ascend W4A8 quantization guide (found by find_string
    #     '"index_n_heads": 32,'; the index names no repository), written by transformers 5.0.2.dev0; the guide
    #     rewrote its architectures / model_type to DeepSeek-V3.2's and replaced its quantization_config;
    #   g5mtp: GLM-5's architectures / model_type / dtype / indexer / MTP fields in a public serving test's
    #     _write_mtp_config (same find_string);
    #   miles: radixark/miles scripts/models/glm5-744B-A40B.sh (Megatron arguments: 3 dense + 75 MoE layers,
    #     hidden 6144, ffn 12288, 64 heads, q/kv lora 2048/512, qk head 192 + rope 64, v head 256, 256 experts
    #     top-8 of 2048 + 1 shared, sigmoid with expert bias, scaling 2.5, vocab 154880, rotary base 1000000);
    #   tf523: transformers 5.23 GlmMoeDsaConfig defaults (its docstring checkpoint is zai-org/GLM-5).
    published = {
        "glm-5": {
            "architectures": ["GlmMoeDsaForCausalLM"],  # g5mtp, tf523 (g5's was rewritten)
            "model_type": "glm_moe_dsa",  # g5mtp, tf523
            "attention_bias": False,  # g5, tf523
            "attention_dropout": 0.0,  # g5, tf523
            "eos_token_id": [154820, 154827, 154829],  # g5
            "pad_token_id": 154820,  # g5
            "vocab_size": 154880,  # g5, miles, tf523
            "hidden_size": 6144,  # g5, miles, tf523
            "head_dim": 64,  # g5, tf523 (the rope head dim; MLA's own dims are below)
            "intermediate_size": 12288,  # g5, miles --ffn-hidden-size
            "moe_intermediate_size": 2048,  # g5, miles
            "num_hidden_layers": 78,  # g5, g5mtp, miles
            "num_attention_heads": 64,  # g5, miles
            "num_key_value_heads": 64,  # g5, tf523
            "n_shared_experts": 1,  # g5, miles
            "n_routed_experts": 256,  # g5, g5mtp, miles
            "routed_scaling_factor": 2.5,  # g5, miles --moe-router-topk-scaling-factor
            "kv_lora_rank": 512,  # g5, g5mtp, miles
            "q_lora_rank": 2048,  # g5, miles
            "qk_head_dim": 256,  # g5
            "qk_rope_head_dim": 64,  # g5, g5mtp, miles --qk-pos-emb-head-dim
            "v_head_dim": 256,  # g5, miles
            "qk_nope_head_dim": 192,  # g5, miles --qk-head-dim
            "n_group": 1,  # g5, tf523
            "topk_group": 1,  # g5, tf523
            "num_experts_per_tok": 8,  # g5, g5mtp, miles
            "norm_topk_prob": True,  # g5, tf523
            "hidden_act": "silu",  # g5, miles --swiglu
            "initializer_range": 0.02,  # g5, tf523
            "max_position_embeddings": 202752,  # g5, g5mtp, tf523
            "rms_norm_eps": 1e-5,  # g5, tf523
            "tie_word_embeddings": False,  # g5, miles --untie-embeddings-and-output-weights
            "first_k_dense_replace": 3,  # g5, g5mtp, miles
            "index_topk": 2048,  # g5, g5mtp, tf523
            "index_head_dim": 128,  # g5, g5mtp, tf523
            "index_n_heads": 32,  # g5, g5mtp, tf523
            "indexer_rope_interleave": True,  # g5 (indexer.InterleavedLightningIndexer)
            "num_nextn_predict_layers": 1,  # g5, g5mtp
            "rope_interleave": True,  # g5, g5mtp
            "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},  # g5 (miles --rotary-base 1000000)
            "torch_dtype": "bfloat16",  # g5 (g5mtp spells it dtype)
            "use_cache": True,  # g5
            "moe_layer_freq": 1,  # g5 (sglang 0.5.23's deepseek_v2.py reads it)
            "topk_method": "noaux_tc",  # g5
            "scoring_func": "sigmoid",  # g5, miles --moe-router-score-function
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
        if types[0] != "full":
            raise ValueError(
                f"config.json indexer_types (or index_topk_freq / index_topk_pattern / index_skip_topk_offset) "
                f"makes layer 0 'shared', with no earlier 'full' layer to reuse ({self.name}): layer 0 must be 'full'"
            )

    def check_layout(self, hf: dict, tp: int, pp: int, ep: int, etp: int | None) -> None:
        """A pipeline stage may not start on a "shared" layer: its selection is made by a full layer of
        the previous stage, and Megatron-Core's pipeline sends the hidden states only (sglang sends
        ``topk_indices`` along; here it would need another P2P tensor per micro-batch). Refusing is exact;
        a stage that starts on a full layer needs nothing from the one before."""
        super().check_layout(hf, tp, pp, ep, etp)
        types, n = indexer_types(hf), int(hf["num_hidden_layers"])
        if pp <= 1 or n % pp:
            return
        starts = [k * n // pp for k in range(1, pp)]
        bad = [i for i in starts if types[i] == "shared"]
        if bad:
            ok = [p for p in range(1, n + 1) if n % p == 0 and all(types[k * n // p] == "full" for k in range(p))]
            raise ValueError(
                f"parallel.pp={pp} starts a pipeline stage on layer {bad[0]}, 'shared' in config.json indexer_types "
                f"({self.name}): its top-k selection is not passed between stages; use a pipeline size whose "
                f"stages all start on 'full' layers: {ok}"
            )

    def megatron_config_class(self):
        from gspo_megatron.models.deepseek_v32.indexer import DSAMLAConfig

        return DSAMLAConfig

    def dims(self, hf: dict):
        d = super().dims(hf)
        shared = tuple(i for i, t in enumerate(indexer_types(hf)) if t == "shared")
        return dataclasses.replace(d, index_shared_layers=shared)

    def config_fields(self, hf: dict) -> dict:
        types = indexer_types(hf)
        return dict(super().config_fields(hf), dsa_indexer_types=types if "shared" in types else None)

    def adapt_layer_spec(self, block_spec, te: bool) -> None:
        from gspo_megatron.models.deepseek_v3 import DeepseekV3
        from gspo_megatron.models.deepseek_v32.indexer import InterleavedDSALocalAttention, use_dsa_attention

        DeepseekV3.adapt_layer_spec(self, block_spec, te)
        use_dsa_attention(block_spec, InterleavedDSALocalAttention)
