"""Qwen3.5-MoE, the language model (Qwen/Qwen3.5-35B-A3B, Qwen3.5-397B-A17B; HF ``model_type``
qwen3_5_moe_text, transformers' own ``Qwen3_5MoeForCausalLM``): Qwen3-Next's hybrid layer stack
(``qwen3_next/``: Gated DeltaNet layers mixed with gated full attention, zero-centered norms, partial
rotary, routed experts with a gated shared expert) with two differences:

- the Gated DeltaNet input projection is stored as four tensors, ``in_proj_qkv`` [q | k | v],
  ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (``qwen3_next/rules.py:GDNInProj`` with ``packed=False``);
- every layer is an MoE layer (no ``mlp_only_layers``), and the rotary embedding is multimodal RoPE
  (``mrope_section``, interleaved): for text, the three position streams are the same token index, so
  each frequency sees that index and the rotation equals plain RoPE on the first
  ``partial_rotary_factor`` of each head (Megatron's ``rotary_percent``).

The published vision-language checkpoint (``Qwen3_5MoeForConditionalGeneration``, ``model_type``
qwen3_5_moe: the language model's config under ``text_config``, its weights under
``model.language_model.`` beside ``lm_head.weight``, the vision tower under ``model.visual.``) trains its
language model; the vision tower is carried through unchanged:

- the config is read with the ``text_config`` fields lifted to the top level
  (``hf_config.lift_text_config``; export writes the file's dict back: ``hf_config.file_config``);
- the mapping is the text model's with ``model.`` -> ``model.language_model.`` (:func:`language_model_names`);
- ``model.visual.*`` (and ``mtp.*``) are carried tensors (``carried_prefixes``, ``models/carried.py``): kept
  beside a checkpoint, written unchanged by export, never sent by the weight sync (the engine keeps the
  vision tower it loaded at start-up); sglang 0.5.23's ``Qwen3_5MoeForConditionalGeneration``
  (``models/qwen3_5.py``) loads the streamed ``model.language_model.*`` names (its ``load_weights``
  rewrites ``model.language_model.`` -> ``model.``).
"""

from __future__ import annotations

from gspo_megatron.models import hf_config
from gspo_megatron.models.mapping import MappingRegistry
from gspo_megatron.models.qwen3_next import Qwen3Next
from gspo_megatron.models.registry import register_family

VL_ARCH = "Qwen3_5MoeForConditionalGeneration"
LM_PREFIX = "model.language_model."
# the tiny vision tower of the tiny vision-language checkpoint (transformers' Qwen3_5MoeVisionConfig kwargs)
TINY_VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    num_position_embeddings=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
TINY_VL_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def is_vision_language(hf: dict) -> bool:
    """The config of the vision-language checkpoint (``text_config`` present)."""
    return isinstance(hf.get("text_config"), dict)


def language_model_names(registry: MappingRegistry) -> MappingRegistry:
    """The text model's mapping with its HF names under ``model.language_model.`` (``lm_head.weight``
    stays), in place; returns ``registry``."""
    for rule in registry.rules:
        rule.hf = tuple(LM_PREFIX + n.removeprefix("model.") if n.startswith("model.") else n for n in rule.hf)
    if registry.fuse_groups:
        raise ValueError("qwen3_5_moe: fuse groups are not renamed for the vision-language checkpoint")
    return registry


# text_config of Qwen/Qwen3.5-35B-A3B's config.json (the language model's fields). Checked: every field equals
# transformers 5.23's Qwen3_5MoeTextConfig defaults (its docstring checkpoint) but max_position_embeddings,
# bos/eos and rope_parameters (theta 1e7, mrope_section), which match a third-party copy of the published file
# (a Qwen3.6-35B-A3B test fixture, same shapes); the hub file itself was not reachable from here.
QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "bos_token_id": 248044,
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 512,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "vocab_size": 248320,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
    },
}


@register_family
class Qwen3_5Moe(Qwen3Next):
    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    architectures = ("Qwen3_5MoeForCausalLM", VL_ARCH)
    in_proj_names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    fp8_modules = Qwen3Next.fp8_modules[:-2] + ("in_proj_qkv", "in_proj_z", "out_proj")
    fp8_excluded = Qwen3Next.fp8_excluded + ("in_proj_b", "in_proj_a")
    sglang_every_layer_sparse = False  # transformers' model is every layer sparse too
    sglang_ties_lm_head = True  # sglang models/qwen3_5_text.py: lm_head = model.embed_tokens when tied
    # (4.x spelling rope_theta / partial_rotary_factor: transformers 5.23 writes rope_parameters with its
    # default interleaved mrope_section)
    tiny = dict(Qwen3Next.tiny, architectures=["Qwen3_5MoeForCausalLM"])
    for _k in ("mlp_only_layers", "decoder_sparse_step", "norm_topk_prob", "intermediate_size"):
        tiny.pop(_k, None)
    published = {"qwen3.5-35b-a3b": QWEN3_5_35B_A3B}

    def check(self, hf: dict) -> None:
        if is_vision_language(hf) and hf_config.LIFTED not in hf:
            raise ValueError(
                f"config.json of model_type {hf.get('model_type')!r}: its text_config fields were not "
                "read (load config.json with models.hf_config.load_hf_config)"
            )
        super().check(hf)

    def tiny_hf_config(self, cfg: dict) -> dict:
        """With ``architectures=["Qwen3_5MoeForConditionalGeneration"]``: the vision-language config (the
        text fields under ``text_config``, a tiny vision tower)."""
        if VL_ARCH not in (cfg.get("architectures") or []):
            return cfg
        text = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
        return dict(
            architectures=[VL_ARCH],
            model_type="qwen3_5_moe",
            text_config=dict(text, model_type="qwen3_5_moe_text"),
            vision_config=dict(TINY_VISION),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            **TINY_VL_TOKENS,
        )

    def carried_prefixes(self, hf: dict) -> tuple[str, ...]:
        return ("model.visual.",) if is_vision_language(hf) else ()

    def mapping(self, hf: dict) -> MappingRegistry:
        registry = super().mapping(hf)
        return language_model_names(registry) if is_vision_language(hf) else registry

    def dims(self, hf: dict):
        """Qwen3-Next's dims; no dense MLP (``intermediate_size`` absent: every layer is MoE)."""
        return super().dims(dict(hf, intermediate_size=hf.get("intermediate_size") or 0))

    def moe_fields(self, hf: dict) -> dict:
        """transformers' router always renormalizes the top-k (``Qwen3VLMoeTextTopKRouter``)."""
        fields = super().moe_fields(hf)
        fields.update(moe_router_pre_softmax=False, moe_layer_freq=1)
        return fields
