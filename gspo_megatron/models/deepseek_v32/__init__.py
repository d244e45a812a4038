"""DeepSeek-V3.2 (HF ``model_type`` deepseek_v32, ``DeepseekV32ForCausalLM``): DeepSeek-V3 (multi-latent
attention, sigmoid router with ``e_score_correction_bias``, group-limited top-k, shared experts, dense
first layers; everything of ``deepseek_v3/``, inherited) plus DeepSeek Sparse Attention in every layer:
a lightning indexer (``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``; ``index_n_heads``,
``index_head_dim``, ``index_topk``) picks, per query, the top-k earlier tokens MLA may attend to
(``indexer.py``: the maths, the tie rule, the layouts).

Megatron-Core 0.16.1: ``experimental_attention_variant="dsa"`` makes ``MLASelfAttention`` hand its core
attention the layer input ``x`` and ``qr = q_a_layernorm(q_a_proj(x))``; the core attention is
``indexer.DSALocalAttention`` on both layer specs. On Transformer Engine's (``deepseek_v3/te_attention.py``:
the MLA linears, parameters and mapping rules of DeepSeek-V3 on TE) the q norm is fused into
``linear_q_up_proj`` and MLA's ``qr`` is unnormalized: ``TEMLASelfAttention`` binds the fused norm into
the core attention (``bind_fused_q_norm``), which applies it before the indexer. Context parallelism:
Megatron-Core's TransformerConfig refuses it with ``experimental_attention_variant="dsa"`` (an
assertion). transformers 5.23 computes MLA with interleaved RoPE always (no ``rope_interleave``
switch) and needs ``q_lora_rank`` (the indexer's query input): refused without it. ``mlp_layer_types`` (5.23's spelling of the dense/sparse layers) must agree
with ``first_k_dense_replace``.

sglang 0.5.23 serves it with ``DeepseekV32ForCausalLM`` (``models/deepseek_v2.py``; the loader in
``deepseek_common/deepseek_weight_loader.py``): the indexer's checkpoint names load as they are (CUDA
fuses ``wk`` + ``weights_proj`` into ``wk_weights_proj`` row by row as each arrives: no fuse group
needed); ``q_a_proj`` + ``kv_a_proj_with_mqa`` fuse as for DeepSeek-V3 (``rules.mla_fuse_groups``).
"""

from __future__ import annotations

from gspo_megatron.models import hf_config
from gspo_megatron.models.deepseek_v3 import DeepseekV3
from gspo_megatron.models.dims import ModelDims
from gspo_megatron.models.family import moe_layer_pattern
from gspo_megatron.models.mapping import MappingRegistry, Replicated
from gspo_megatron.models.registry import register_family
from gspo_megatron.models.rules import H, L

INDEXER = (
    ("linear_wq_b.weight", "wq_b.weight"),
    ("linear_wk.weight", "wk.weight"),
    ("k_norm.weight", "k_norm.weight"),
    ("k_norm.bias", "k_norm.bias"),
    ("linear_weights_proj.weight", "weights_proj.weight"),
)


def indexer_rules() -> list:
    """The DSA indexer of every layer: replicated over TP (each rank computes the whole selection)."""
    return [
        Replicated(f"{L}.self_attention.core_attention.indexer.{m}", f"{H}.self_attn.indexer.{h}") for m, h in INDEXER
    ]


@register_family
class DeepseekV32(DeepseekV3):
    name = "deepseek_v32"
    architectures = ("DeepseekV32ForCausalLM",)
    sglang_modules = {"DeepseekV32ForCausalLM": "deepseek_v2"}
    hf_router_classes = ("DeepseekV32TopkRouter",)
    hf_router_perturbable = False  # sigmoid router with a bias and group-limited choice
    hf_indexer_classes = ("DeepseekV32Indexer",)
    tiny = dict(
        {k: v for k, v in DeepseekV3.tiny.items() if k not in ("rope_interleave",)},
        architectures=["DeepseekV32ForCausalLM"],
        # index_topk below the test sequences' lengths (up to 23 and 61 tokens): the sparse path is the one run
        index_topk=6,
        index_n_heads=4,
        index_head_dim=16,
    )
    # deepseek-ai/DeepSeek-V3.2 (and V3.2-Exp). The hub file is not reachable from here; the values were checked
    # against:
    #   v32inf: DeepSeek's inference config of V3.2-Exp (awesome-mini-project/DeepSeek-V3.2-Exp
    #     inference/config_671B_v3.2.json, a fork of deepseek-ai/DeepSeek-V3.2-Exp): vocab 129280, dim 7168,
    #     inter 18432, moe inter 2048, 61 layers, 3 dense, 128 heads, 256 routed + 1 shared top-8, 8 groups top-4,
    #     route scale 2.5, sigmoid, q/kv lora 1536/512, qk nope/rope 128/64, v 128, max_seq_len 163840,
    #     index_n_heads 64, index_head_dim 128, index_topk 2048: DeepSeek-V3's shapes, so DeepSeek-V3's dict
    #     (deepseek_v3/__init__.py) is taken for the rest;
    #   v32hf: config.json fixtures of DeepseekV32ForCausalLM in public tests (found by find_string
    #     '"model_type": "deepseek_v32",'; the index names no repository): architectures, model_type, the same
    #     shapes, moe_layer_freq 1, topk_method noaux_tc, norm_topk_prob, num_nextn_predict_layers 1, rope_scaling
    #     yarn factor 40 / original 4096, index_* as above; zianglih/miles scripts/models/deepseek-v32.sh agrees
    #     (rotary scaling factor 40, base 10000, mscale 1.0 / 1.0).
    published = {
        "deepseek-v3.2": {
            **{
                k: v for k, v in DeepseekV3.published["deepseek-v3"].items() if k not in ("architectures", "model_type")
            },
            "architectures": ["DeepseekV32ForCausalLM"],  # v32hf
            "model_type": "deepseek_v32",  # v32hf
            "index_head_dim": 128,  # v32inf, v32hf
            "index_n_heads": 64,  # v32inf, v32hf
            "index_topk": 2048,  # v32inf, v32hf
        },
    }

    def check(self, hf: dict) -> None:
        super().check(hf)
        if not hf.get("q_lora_rank"):
            raise ValueError(
                f"config.json q_lora_rank null is not supported for {self.name} (the indexer's query "
                "input is q_a_layernorm(q_a_proj(x)))"
            )
        types = hf.get("mlp_layer_types")
        if types is not None and [t == "sparse" for t in types] != [bool(m) for m in moe_layer_pattern(hf)]:
            raise ValueError(
                f"config.json mlp_layer_types {types} disagrees with first_k_dense_replace "
                f"{hf.get('first_k_dense_replace')} for {self.name}"
            )
        g = hf_config.get_int
        if g(hf, "index_head_dim") <= g(hf, "qk_rope_head_dim"):
            raise ValueError(
                f"config.json index_head_dim {g(hf, 'index_head_dim')} must exceed qk_rope_head_dim for {self.name}"
            )

    def adapt_layer_spec(self, block_spec, te: bool) -> None:
        super().adapt_layer_spec(block_spec, te)
        from gspo_megatron.models.deepseek_v32.indexer import use_dsa_attention

        use_dsa_attention(block_spec)

    def config_fields(self, hf: dict) -> dict:
        g = hf_config.get_int
        return dict(
            super().config_fields(hf),
            experimental_attention_variant="dsa",
            dsa_indexer_n_heads=g(hf, "index_n_heads"),
            dsa_indexer_head_dim=g(hf, "index_head_dim"),
            dsa_indexer_topk=g(hf, "index_topk"),
            dsa_indexer_loss_coeff=0.0,
        )

    def mapping(self, hf: dict) -> MappingRegistry:
        base = super().mapping(dict(hf, rope_interleave=True))  # transformers' V3.2 MLA: always interleaved
        return MappingRegistry(base.rules + indexer_rules(), base.fuse_groups)

    def dims(self, hf: dict) -> ModelDims:
        g = hf_config.get_int
        return ModelDims(
            **{
                **super().dims(hf).__dict__,
                "model_type": self.name,
                "index_n_heads": g(hf, "index_n_heads"),
                "index_head_dim": g(hf, "index_head_dim"),
                "index_topk": g(hf, "index_topk"),
            }
        )
