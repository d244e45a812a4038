"""DeepSeek-V3 / R1, Kimi-K2, Moonlight (HF ``model_type`` deepseek_v3): multi-latent attention
(with or without ``q_lora_rank``), RoPE or YaRN with its mscale, ``rope_interleave``; MoE with a
sigmoid router plus ``e_score_correction_bias`` for the choice, group-limited top-k
(``n_group`` / ``topk_group``), renormalized top-k scaled by ``routed_scaling_factor``,
``n_shared_experts`` ungated shared experts, ``first_k_dense_replace`` dense first layers.

Megatron-Core 0.16.1: ``MLATransformerConfig`` + MLASelfAttention on the local spec; the router's
``moe_router_score_function="sigmoid"`` with ``moe_router_enable_expert_bias``. The correction bias
is the router's ``expert_bias`` buffer: loaded from and exported to ``mlp.gate.e_score_correction_bias``,
never trained by the policy loss, and frozen (``moe_router_bias_update_rate=0``: Megatron's
aux-loss-free balancing update is off), so export and weight sync send the checkpoint's value.

Refused with one line (Megatron-Core computes something else): ``norm_topk_prob=false`` with top-k > 1
(Megatron always renormalizes sigmoid top-k), group-limited routing where ``num_experts_per_tok //
topk_group != 2`` (Megatron scores a group by its top-(topk/topk_group) experts, transformers by its
top-2), an explicit YaRN ``attention_factor`` or ``truncate=false``, ``attention_bias=true``.
Both layer specs: Transformer Engine's MLA spec keeps the down projections whole on every TP rank
(``TELinear`` "duplicated") and fuses the q / kv norms into the up projections; the mapping has one
rule per spec where they differ (``rules.mla_attention_rules``), and ``te_attention.py`` lists the
per-rank layout and fixes the grad norm's count of the duplicated weights. On the local spec
Megatron-Core 0.16.1's core attention lacks MLA's ``k_channels`` / ``v_channels`` arguments:
``local_attention.py`` adds them. The multi-token-prediction layers of the published
checkpoints (``num_nextn_predict_layers``) are not part of transformers' model: not loaded, not trained,
carried unchanged through conversion and export (``models/carried.py``).
"""

from __future__ import annotations

import torch.nn.functional as F

from gspo_megatron.models import hf_config
from gspo_megatron.models.dims import ModelDims
from gspo_megatron.models.family import ModelFamily, moe_layer_pattern, sigmoid_router_check, sigmoid_router_fields
from gspo_megatron.models.mapping import MappingRegistry
from gspo_megatron.models.registry import register_family
from gspo_megatron.models.rules import (
    ExpertNaming,
    dense_mlp_rules,
    embedding_rules,
    mla_attention_rules,
    mla_fuse_groups,
    pre_mlp_norm_rules,
    routed_expert_rules,
    router_bias_rule,
    shared_expert_rules,
)


@register_family
class DeepseekV3(ModelFamily):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    sglang_modules = {"DeepseekV3ForCausalLM": "deepseek_v2"}
    sglang_draft_modules = {"DeepseekV3ForCausalLMNextN": "deepseek_nextn"}
    mtp_trainable = True
    sglang_draft_path_defaulted = True  # in _handle_eagle_family's list (subclass families too)
    sglang_ties_lm_head = True  # sglang's deepseek_v2.py: lm_head = embed_tokens when tied (engine pp 1)
    expert_naming = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj")
    fp8_modules = (
        "q_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    tiny = dict(
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        rope_interleave=True,
        rope_theta=10000.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_scaling=dict(
            type="yarn",
            factor=4.0,
            original_max_position_embeddings=128,
            mscale=1.0,
            mscale_all_dim=1.0,
            beta_fast=32,
            beta_slow=1,
        ),
        # in every published DeepSeek-V3 config.json (not transformers' config defaults); sglang 0.5.23's
        # deepseek_v2.py reads all three (config.moe_layer_freq, topk_method, scoring_func)
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )

    published = {
        "deepseek-v3": {  # deepseek-ai/DeepSeek-V3 (also R1 / V3-0324 / V3.1: same shapes); fp8 weights on disk
            "architectures": ["DeepseekV3ForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "first_k_dense_replace": 3,
            "hidden_act": "silu",
            "hidden_size": 7168,
            "initializer_range": 0.02,
            "intermediate_size": 18432,
            "kv_lora_rank": 512,
            "max_position_embeddings": 163840,
            "model_type": "deepseek_v3",
            "moe_intermediate_size": 2048,
            "moe_layer_freq": 1,
            "n_group": 8,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "num_attention_heads": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 61,
            "num_key_value_heads": 128,
            "num_nextn_predict_layers": 1,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "rms_norm_eps": 1e-06,
            "rope_scaling": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 40,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            "rope_theta": 10000,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "topk_group": 4,
            "topk_method": "noaux_tc",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "use_cache": True,
            "v_head_dim": 128,
            "vocab_size": 129280,
        },
    }

    # -- checks -----------------------------------------------------------------------------------
    def check(self, hf: dict) -> None:
        def no(cond, msg):
            if cond:
                raise ValueError(f"config.json {msg} is not supported for {self.name}")

        no(hf.get("attention_bias"), "attention_bias=true")
        no(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}")
        no(hf.get("scoring_func", "sigmoid") != "sigmoid", f"scoring_func {hf.get('scoring_func')!r}")
        no(int(hf.get("moe_layer_freq") or 1) != 1, f"moe_layer_freq {hf.get('moe_layer_freq')}")
        rope = hf_config.rope_parameters(hf)
        no(rope["rope_type"] not in ("default", "yarn"), f"rope type {rope['rope_type']!r}")
        if rope["rope_type"] == "yarn":
            no(rope.get("attention_factor") is not None, "rope attention_factor (YaRN)")
            no(rope.get("truncate", True) is False, "rope truncate=false (YaRN)")
        sigmoid_router_check(hf, self.name)

    def adapt_layer_spec(self, block_spec, te: bool) -> None:
        if te:
            from gspo_megatron.models.deepseek_v3.te_attention import use_te_mla_attention

            use_te_mla_attention(block_spec)
        else:
            from gspo_megatron.models.deepseek_v3.local_attention import use_local_mla_attention

            use_local_mla_attention(block_spec)

    def tp_divisible(self, hf: dict) -> list[tuple[str, int]]:
        """Dims the local spec splits over TP besides heads (the MLA down projections; TE's spec keeps
        them whole, and a layout is meant to run on both)."""
        out = [
            (
                "kv_lora_rank + qk_rope_head_dim",
                hf_config.get_int(hf, "kv_lora_rank") + hf_config.get_int(hf, "qk_rope_head_dim"),
            )
        ]
        if hf.get("q_lora_rank"):
            out.append(("q_lora_rank", int(hf["q_lora_rank"])))
        return out

    # -- Megatron config ------------------------------------------------------------------------
    def megatron_config_class(self):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def rotary_kwargs(self, hf: dict) -> dict:
        return dict(position_embedding_type="rope")  # MLA builds its own rotary embedding

    def rope_fields(self, hf: dict) -> dict:
        rope = hf_config.rope_parameters(hf)
        fields = dict(rotary_base=rope["rope_theta"], rotary_percent=1.0, rotary_interleaved=False)
        if rope["rope_type"] == "default":
            # rotary_scaling_factor 1: no YaRN mscale in the softmax scale (Megatron applies it always)
            return dict(fields, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        orig = int(rope.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
        factor = rope.get("factor") or hf_config.get_int(hf, "max_position_embeddings") / orig
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        if not (m and m_all):  # transformers: attention factor get_mscale(factor), no softmax mscale
            m, m_all = 1.0, 0.0
        return dict(
            fields,
            rope_type="yarn",
            rotary_scaling_factor=float(factor),
            original_max_position_embeddings=orig,
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(m),
            mscale_all_dim=float(m_all),
        )

    def config_fields(self, hf: dict) -> dict:
        self.check(hf)
        g = hf_config.get_int
        heads = g(hf, "num_attention_heads")
        pattern = moe_layer_pattern(hf)
        fields = dict(
            num_layers=g(hf, "num_hidden_layers"),
            hidden_size=g(hf, "hidden_size"),
            num_attention_heads=heads,
            num_query_groups=heads,
            ffn_hidden_size=g(hf, "intermediate_size"),
            multi_latent_attention=True,
            q_lora_rank=hf.get("q_lora_rank") or None,
            kv_lora_rank=g(hf, "kv_lora_rank"),
            qk_head_dim=g(hf, "qk_nope_head_dim"),
            qk_pos_emb_head_dim=g(hf, "qk_rope_head_dim"),
            v_head_dim=g(hf, "v_head_dim"),
            kv_channels=g(hf, "v_head_dim"),  # sizes the attention output (local_attention.py)
            normalization="RMSNorm",
            layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
            qk_layernorm=True,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            num_moe_experts=hf_config.num_experts(hf),
            moe_router_topk=g(hf, "num_experts_per_tok"),
            moe_ffn_hidden_size=g(hf, "moe_intermediate_size"),
            moe_shared_expert_intermediate_size=(
                g(hf, "moe_intermediate_size") * int(hf.get("n_shared_experts") or 0) or None
            ),
            moe_layer_freq=1 if all(pattern) else pattern,
        )
        fields.update(sigmoid_router_fields(hf))
        fields.update(self.rope_fields(hf))
        return fields

    # -- weights ----------------------------------------------------------------------------------
    def mapping(self, hf: dict) -> MappingRegistry:
        rules = embedding_rules(hf) + mla_attention_rules(hf) + pre_mlp_norm_rules() + dense_mlp_rules()
        rules += routed_expert_rules(self.expert_naming) + [router_bias_rule("mlp.gate.e_score_correction_bias")]
        if hf.get("n_shared_experts"):
            rules += shared_expert_rules("mlp.shared_experts")
        # q_a_proj + kv_a_proj_with_mqa reach sglang in one load_weights call (rules.mla_fuse_groups)
        return MappingRegistry(rules, mla_fuse_groups(hf))

    # -- planner ----------------------------------------------------------------------------------
    def dims(self, hf: dict) -> ModelDims:
        g = hf_config.get_int
        heads, nope, rope = g(hf, "num_attention_heads"), g(hf, "qk_nope_head_dim"), g(hf, "qk_rope_head_dim")
        moe_ffn = g(hf, "moe_intermediate_size")
        return ModelDims(
            model_type=self.name,
            vocab_size=g(hf, "vocab_size"),
            hidden=g(hf, "hidden_size"),
            num_layers=g(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=heads,
            head_dim=nope + rope,
            ffn_hidden=g(hf, "intermediate_size"),
            moe_ffn_hidden=moe_ffn,
            num_experts=hf_config.num_experts(hf),
            topk=g(hf, "num_experts_per_tok"),
            moe_layers=tuple(i for i, m in enumerate(moe_layer_pattern(hf)) if m),
            qk_norm=False,
            qkv_bias=False,
            o_bias=False,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 1 << 30),
            rope_type=hf_config.rope_type(hf),
            shared_expert_ffn=moe_ffn * int(hf.get("n_shared_experts") or 0),
            q_lora_rank=int(hf.get("q_lora_rank") or 0),
            kv_lora_rank=g(hf, "kv_lora_rank"),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=g(hf, "v_head_dim"),
        )
