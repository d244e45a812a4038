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
- ``model.visual.*`` (and ``mtp.*`` without ``model.mtp``) are carried tensors (``carried_prefixes``,
  ``models/carried.py``): kept beside a checkpoint, written unchanged by export, never sent by the weight sync
  (the engine keeps the vision tower it loaded at start-up); sglang 0.5.23's ``Qwen3_5MoeForConditionalGeneration``
  (``models/qwen3_5.py``) loads the streamed ``model.language_model.*`` names (its ``load_weights``
  rewrites ``model.language_model.`` -> ``model.``).

The MTP layer (``mtp.*``, ``mtp_num_hidden_layers``; text and vision-language checkpoints alike) is Qwen3-Next's
(``models/mtp.py`` ``MTP_BRANCH``, the family's MTP layer spec): with ``model.mtp`` it is trained and synced to
sglang 0.5.23's draft ``Qwen3_5ForCausalLMMTP`` (``srt/models/qwen3_5_mtp.py`` ``load_weights``: ``mtp.`` ->
``model.``, ``fc`` / ``pre_fc_norm_*`` at its top; of the other names only the embedding, which the draft shares
with the target).
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


# The language-model fields (``text_config``) of the published config.json files. The hub files themselves are
# not reachable from here; each value names the public copies it was checked against (short names below):
#   slime35 / slime397: THUDM/slime scripts/models/qwen3.5-35B-A3B.sh / qwen3.5-397B-A17B.sh (Megatron architecture
#     arguments: layers, hidden, heads, kv groups, kv-channels, vocab, norm eps, rotary percent and base, experts,
#     top-k, expert and shared-expert sizes, linear-attention heads for 35B);
#   q36copy: a pinned copy of Qwen/Qwen3.6-35B-A3B's config.json (same architecture and model_type as
#     Qwen3.5-35B-A3B, transformers' docs/source/en/model_doc/qwen3_5_moe.md) in a public worker module (found by
#     find_string '"mtp_num_hidden_layers": 1,'; the index names no repository): every text_config field;
#   tf523: transformers 5.23 Qwen3_5MoeTextConfig defaults (its docstring checkpoint is Qwen/Qwen3.5-35B-A3B);
#   c397: public copies of Qwen3.5-397B-A17B's text_config (a Rust test of a nested Qwen3_5MoeForConditionalGeneration
#     config; a Python model_config() with layer_types; a resource-plan test of the 397B's state geometry; found by
#     find_string '"shared_expert_intermediate_size": 1024,' / '"linear_num_value_heads": 64'), and the
#     mlx-community/Qwen3.5-397B-A17B-4bit model card (pages corpus: 60 layers = 15 x (3 Gated DeltaNet + 1 full),
#     512 experts, 10 routed + 1 shared, expert size 1024, 32 Q / 2 KV heads of 256, linear heads 16 QK / 64 V of
#     128, 262,144 context, vocab 248,320).
# NVIDIA-NeMo/Megatron-Bridge's Qwen3.5 bridge test fixture for the 397B ("a sample configuration") disagrees with
# all of these on bos/eos (248045/248046) and shared_expert_intermediate_size (4096): not used.
def _hybrid_layer_types(n: int, every: int = 4) -> list[str]:
    """``layer_types`` as the published files list them: every ``every``-th layer full attention."""
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]


QWEN3_5_35B_A3B = {
    "architectures": ["Qwen3_5MoeForCausalLM"],  # the text model's class (the hub file: the VL class, text_config)
    "model_type": "qwen3_5_moe_text",  # q36copy text_config.model_type
    "attention_bias": False,  # q36copy, tf523
    "attention_dropout": 0.0,  # q36copy, tf523
    "attn_output_gate": True,  # q36copy (slime35 --attention-output-gate)
    "bos_token_id": 248044,  # q36copy (Qwen/Qwen3.5-0.8B's hub text_config omits it; unused in training)
    "eos_token_id": 248044,  # q36copy
    "full_attention_interval": 4,  # q36copy, slime35 --linear-attention-freq 4
    "head_dim": 256,  # q36copy, slime35 --kv-channels 256
    "hidden_act": "silu",  # q36copy, slime35 --swiglu
    "hidden_size": 2048,  # q36copy, slime35
    "initializer_range": 0.02,  # q36copy
    "layer_types": _hybrid_layer_types(40),  # q36copy (30 linear, 10 full)
    "linear_conv_kernel_dim": 4,  # q36copy, slime35
    "linear_key_head_dim": 128,  # q36copy, slime35
    "linear_num_key_heads": 16,  # q36copy, slime35
    "linear_num_value_heads": 32,  # q36copy, slime35
    "linear_value_head_dim": 128,  # q36copy, slime35
    "mamba_ssm_dtype": "float32",  # q36copy (sglang's recurrent-state dtype)
    "max_position_embeddings": 262144,  # q36copy (tf523 default 32768 is not the checkpoint's)
    "moe_intermediate_size": 512,  # q36copy, slime35 --moe-ffn-hidden-size
    "mtp_num_hidden_layers": 1,  # q36copy (the mtp.* layer: carried, or trained with model.mtp)
    "mtp_use_dedicated_embeddings": False,  # q36copy
    "num_attention_heads": 16,  # q36copy, slime35
    "num_experts": 256,  # q36copy, slime35
    "num_experts_per_tok": 8,  # q36copy, slime35 --moe-router-topk
    "num_hidden_layers": 40,  # q36copy, slime35
    "num_key_value_heads": 2,  # q36copy, slime35 --num-query-groups
    "output_router_logits": False,  # q36copy
    "partial_rotary_factor": 0.25,  # q36copy (also inside rope_parameters), slime35 --rotary-percent
    "rms_norm_eps": 1e-06,  # q36copy, slime35 --norm-epsilon
    "router_aux_loss_coef": 0.001,  # q36copy, tf523
    "shared_expert_intermediate_size": 512,  # q36copy, slime35
    "tie_word_embeddings": False,  # q36copy, slime35 --untie-embeddings-and-output-weights
    "use_cache": True,  # q36copy
    "dtype": "bfloat16",  # q36copy
    "vocab_size": 248320,  # q36copy, slime35
    "rope_parameters": {  # q36copy; theta also slime35 --rotary-base 10000000
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
}

# Qwen/Qwen3.5-397B-A17B: the 35B's text_config schema (one release, one transformers class) with the 397B's
# shapes. Shapes from slime397 and c397 (which agree on every one); the fields not naming c397/slime397 were not
# found for the 397B itself: the 35B's value (q36copy), marked "as the 35B".
QWEN3_5_397B_A17B = dict(
    QWEN3_5_35B_A3B,
    full_attention_interval=4,  # c397, mlx-community card (15 x (3 + 1))
    head_dim=256,  # c397, slime397 --kv-channels 256
    hidden_size=4096,  # c397, slime397
    layer_types=_hybrid_layer_types(60),  # c397 (45 linear, 15 full)
    linear_num_key_heads=16,  # c397, mlx-community card
    linear_num_value_heads=64,  # c397, mlx-community card
    max_position_embeddings=262144,  # c397, mlx-community card
    moe_intermediate_size=1024,  # c397, slime397 --moe-ffn-hidden-size
    num_attention_heads=32,  # c397, slime397
    num_experts=512,  # c397, slime397
    num_experts_per_tok=10,  # c397, slime397 --moe-router-topk
    num_hidden_layers=60,  # c397, slime397
    num_key_value_heads=2,  # c397, slime397 --num-query-groups
    shared_expert_intermediate_size=1024,  # c397, slime397 --moe-shared-expert-intermediate-size
    vocab_size=248320,  # c397, slime397
    # as the 35B: bos/eos, rms_norm_eps (slime397 --norm-epsilon 1e-6 agrees), rope_parameters (c397 and slime397:
    # theta 1e7, partial 0.25), linear head dims 128 and kernel 4 (c397), the MTP and dtype fields
)


@register_family
class Qwen3_5Moe(Qwen3Next):
    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    architectures = ("Qwen3_5MoeForCausalLM", VL_ARCH)
    sglang_modules = {"Qwen3_5MoeForCausalLM": "qwen3_5_text", VL_ARCH: "qwen3_5"}
    # sglang 0.5.23 configs/model_config.py renames both architectures to Qwen3_5ForCausalLMMTP for the draft
    sglang_draft_modules = {"Qwen3_5ForCausalLMMTP": "qwen3_5_mtp"}
    mtp_trainable = True
    # the vision-language checkpoint: its language model under model.language_model.; the vision tower
    # (model.visual. in the checkpoint, visual. in sglang's class) is carried, never synced
    sglang_kept_from_start = {VL_ARCH: ("visual.",)}
    language_model_prefix = LM_PREFIX
    language_model_excluded = ("model.visual.", "visual.")
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
    published = {"qwen3.5-35b-a3b": QWEN3_5_35B_A3B, "qwen3.5-397b-a17b": QWEN3_5_397B_A17B}

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
