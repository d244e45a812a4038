"""MiniMax-M2 (MiniMaxAI/MiniMax-M2, 230B total / 10B active; HF ``model_type`` minimax_m2,
transformers' own ``MiniMaxM2ForCausalLM``): GQA without biases; a q/k RMSNorm over the WHOLE
projection width (one statistic over all heads: ``qk_norm.py``); partial rotary (``rotary_dim`` of
``head_dim``, rotate-half on the first ``rotary_dim`` channels of each head: Megatron's
``rotary_percent``); every layer MoE with Mixtral's checkpoint naming (``block_sparse_moe``, experts
``w1`` / ``w3`` / ``w2``, expert size ``intermediate_size``), no shared expert, no dense layer; a
sigmoid router whose choice adds ``block_sparse_moe.e_score_correction_bias``:

    s = sigmoid(x @ W_gate^T)                    # [tokens, E], fp32
    top = topk(s + bias, k)                      # the bias only chooses
    p = s[top] / sum(s[top])                     # renormalized, no routed scaling

which is Megatron-Core's ``moe_router_score_function="sigmoid"`` with the router's ``expert_bias``
buffer (``family.sigmoid_router_fields``: frozen, exported and synced as loaded).

transformers ignores the config flags ``use_qk_norm``, ``qk_norm_type``, ``use_routing_bias`` and
``scoring_func`` (its model always has both norms, the bias and the sigmoid); sglang 0.5.23
(``srt/models/minimax_m2.py``) reads them, and ``rotary_dim`` (default: full rotary). So the trainer
follows transformers, and ``sglang_errors`` names each flag whose value would make sglang's class
compute something else. The multi-token-prediction modules of the published checkpoint
(``num_mtp_modules``, ``model.layers.{62..64}.*``) are not part of transformers' model: not loaded.
"""

from __future__ import annotations

from gspo_megatron.models import hf_config
from gspo_megatron.models.dims import ModelDims
from gspo_megatron.models.family import GQAFamily, sigmoid_router_check, sigmoid_router_fields
from gspo_megatron.models.mapping import ColumnParallel, MappingRegistry
from gspo_megatron.models.registry import register_family
from gspo_megatron.models.rules import ExpertNaming, H, L, router_bias_rule

# Published config.json of MiniMaxAI/MiniMax-M2 (remote-code spelling: rotary_dim, 4.x rope_theta). The hub file is
# not reachable from here; each value names the public copies it was checked against:
#   m25: a full copy of MiniMax-M2.5's config.json (the same architecture; M2.1 / M2.5 "identical architecture" to
#     M2 in a public param-count test) in a public Ascend quantization guide (found by find_string
#     '"num_mtp_modules": 3'; the index names no repository): every key it lists is listed here with its value;
#   m2fix: a MiniMax-M2 config fixture in a public Go loader test (same find_string): architecture, model_type,
#     sizes, heads, head_dim, max_position_embeddings 196608, experts, top-k, scoring, routing bias, MTP, qk norm,
#     rotary_dim, rope_theta;
#   miles: radixark/miles scripts/models/minimax-m2.sh (Megatron arguments: 62 layers, hidden 3072, vocab 200064,
#     48 heads / 8 groups of 128, 256 experts top-8 of 1536, sigmoid router with expert bias, rotary percent 0.5,
#     rotary base 5000000);
#   tf523: transformers 5.23 MiniMaxM2Config defaults, for the keys m25 does not list (not found in any source
#     reachable here as values of the M2 file).
# Left out: auto_map, transformers_version, and the quantization_config of the FP8 weights on disk.
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"],  # m25, m2fix
    "attention_dropout": 0.0,  # not in m25: tf523 default
    "attn_type_list": [1] * 62,  # m25 (62 entries, all 1: full attention)
    "head_dim": 128,  # m25, m2fix, miles --kv-channels
    "hidden_act": "silu",  # m25
    "hidden_size": 3072,  # m25, m2fix, miles
    "initializer_range": 0.02,  # not in m25: tf523 default
    "intermediate_size": 1536,  # m25, m2fix, miles --moe-ffn-hidden-size (the expert size)
    "max_position_embeddings": 196608,  # m25, m2fix
    "model_type": "minimax_m2",  # m25, m2fix
    "mtp_transformer_layers": 1,  # m25, m2fix
    "num_attention_heads": 48,  # m25, m2fix, miles
    "num_experts_per_tok": 8,  # m25, m2fix, miles --moe-router-topk
    "num_hidden_layers": 62,  # m25, m2fix, miles
    "num_key_value_heads": 8,  # m25, m2fix, miles --num-query-groups
    "num_local_experts": 256,  # m25, m2fix, miles --num-experts
    "output_router_logits": False,  # not in m25: tf523 default
    "qk_norm_type": "per_layer",  # m25
    "rms_norm_eps": 1e-06,  # m25
    "rope_theta": 5000000,  # m25, m2fix, miles --rotary-base
    "rotary_dim": 64,  # m25, m2fix (miles --rotary-percent 0.5 of head_dim 128)
    "router_aux_loss_coef": 0.001,  # not in m25: tf523 default
    "router_jitter_noise": 0.0,  # not in m25: tf523 default
    "scoring_func": "sigmoid",  # m25, m2fix, miles --moe-router-score-function
    "shared_intermediate_size": 0,  # m25
    "tie_word_embeddings": False,  # m25, miles --untie-embeddings-and-output-weights
    "torch_dtype": "bfloat16",  # m25
    "use_cache": True,  # m25
    "use_qk_norm": True,  # m25, m2fix
    "use_routing_bias": True,  # m25, m2fix (miles --moe-router-enable-expert-bias)
    "vocab_size": 200064,  # m25, m2fix, miles
    "num_mtp_modules": 3,  # m25, m2fix
    "use_mtp": True,  # m25, m2fix
}


@register_family
class MiniMaxM2(GQAFamily):
    name = "minimax_m2"
    architectures = ("MiniMaxM2ForCausalLM",)
    sglang_modules = {"MiniMaxM2ForCausalLM": "minimax_m2"}
    expert_naming = ExpertNaming("block_sparse_moe", "w1", "w3", "w2")
    fp8_modules = GQAFamily.fp8_modules + ("w1", "w2", "w3")
    qk_norm = False  # not Megatron's per-head qk_layernorm: the full-width norm of qk_norm.py
    tiny = dict(
        architectures=["MiniMaxM2ForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rotary_dim=8,
        num_local_experts=8,
        num_experts_per_tok=3,
        rms_norm_eps=1e-6,
        rope_theta=5e6,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        # the published config's flags (transformers ignores them; sglang's class reads them)
        use_qk_norm=True,
        qk_norm_type="per_layer",
        use_routing_bias=True,
        scoring_func="sigmoid",
    )
    published = {"minimax-m2": MINIMAX_M2}

    # -- checks -----------------------------------------------------------------------------------
    def check(self, hf: dict) -> None:
        super().check(hf)
        sigmoid_router_check(hf, self.name)
        if hf_config.rope_type(hf) != "default" and hf_config.partial_rotary_factor(hf) != 1.0:
            raise ValueError(
                f"config.json rotary_dim / partial_rotary_factor with rope type "
                f"{hf_config.rope_type(hf)!r} is not supported for {self.name} (Megatron's YaRN spans the head)"
            )
        types = hf.get("attn_type_list")
        if types and any(int(t) != 1 for t in types):
            raise ValueError(
                f"config.json attn_type_list with linear-attention layers (0) is not supported for "
                f"{self.name} (MiniMax-M2 is full attention in every layer)"
            )

    def sglang_errors(self, hf: dict) -> list[str]:
        e = super().sglang_errors(hf)
        cls = self.architectures[0]
        flags = {"use_qk_norm": True, "use_routing_bias": True, "scoring_func": "sigmoid", "qk_norm_type": "per_layer"}
        for key, want in flags.items():
            if hf.get(key, None if key != "qk_norm_type" else "per_layer") != want:
                e.append(
                    f"config.json {key}={hf.get(key)!r} is not supported with rollout.engine=sglang for "
                    f"{self.name}: sglang's {cls} reads it and would not compute what transformers' model "
                    f"(and the trainer) computes; set {key}: {want!r}"
                )
        if hf_config.partial_rotary_factor(hf) != 1.0 and hf.get("rotary_dim") is None:
            e.append(
                f"config.json has partial rotary but no rotary_dim, which sglang's {cls} reads (default: full "
                f"rotary); add rotary_dim: {int(hf_config.partial_rotary_factor(hf) * hf_config.head_dim(hf))}"
            )
        return e

    # -- Megatron config --------------------------------------------------------------------------
    def moe_ffn_hidden(self, hf: dict) -> int:
        return hf_config.get_int(hf, "intermediate_size")

    def moe_fields(self, hf: dict) -> dict:
        fields = super().moe_fields(hf)
        fields.update(sigmoid_router_fields(hf))
        fields.update(moe_router_pre_softmax=False, moe_layer_freq=1)
        return fields

    def adapt_layer_spec(self, block_spec, te: bool) -> None:
        from gspo_megatron.models.minimax_m2.qk_norm import use_full_width_qk_norm

        use_full_width_qk_norm(block_spec)

    # -- weights ----------------------------------------------------------------------------------
    def mapping(self, hf: dict) -> MappingRegistry:
        """GQA + Mixtral-named experts + the router bias; the full-width q/k norm weights split over
        TP with the heads (rank r: rows [r*H*d/tp, (r+1)*H*d/tp), as its q/k rows)."""
        registry = super().mapping(hf)
        registry.rules += [
            ColumnParallel(f"{L}.self_attention.q_layernorm.weight", f"{H}.self_attn.q_norm.weight", "tp"),
            ColumnParallel(f"{L}.self_attention.k_layernorm.weight", f"{H}.self_attn.k_norm.weight", "tp"),
            router_bias_rule("block_sparse_moe.e_score_correction_bias"),
        ]
        return registry

    # -- planner ----------------------------------------------------------------------------------
    def dims(self, hf: dict) -> ModelDims:
        from dataclasses import replace

        return replace(super().dims(hf), qk_norm=True, qk_norm_full_width=True)
