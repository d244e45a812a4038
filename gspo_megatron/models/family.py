"""Model families: what each HF architecture means for Megatron-Core, and the family registry.

A family turns an HF ``config.json`` (as a dict) into Megatron ``TransformerConfig`` fields and a
weight mapping. The per-family folders (``qwen3_moe/``, ``mixtral/``, ``qwen2/``, ``qwen3/``) hold
only what differs; the decoder layout shared by these Llama-style families is written once here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.nn.functional as F

from gspo_megatron.models.mapping import (
    AttentionDims,
    ColumnParallel,
    FusedQKV,
    GatedFC1,
    MappingRegistry,
    Replicated,
    RowParallel,
    Rule,
)

L = "decoder.layers.*"  # Megatron layer prefix
H = "model.layers.*"  # HF layer prefix


@dataclass
class ModelFamily:
    """One HF architecture family.

    config_fields(hf) -> dict of TransformerConfig kwargs specific to the family (MoE routing, norms).
    moe_block / expert names: HF names of the router and the per-expert gate/up/down projections.
    """

    name: str
    architectures: tuple[str, ...]
    config_fields: Callable[[dict], dict]
    router_hf: str | None = None  # e.g. "mlp.gate.weight"
    expert_hf: tuple[str, str, str] | None = None  # gate, up, down with "*" for the expert
    qk_norm: bool = False
    extra_rules: Callable[[dict], list[Rule]] = field(default=lambda hf: [])

    def is_moe(self, hf: dict) -> bool:
        return self.expert_hf is not None

    def mapping(self, hf: dict) -> MappingRegistry:
        """All rules for this family given the HF config (head dims, tying)."""
        dims = attention_dims(hf)
        rules: list[Rule] = [
            ColumnParallel("embedding.word_embeddings.weight", "model.embed_tokens.weight", "tp"),
            Replicated("decoder.final_layernorm.weight", "model.norm.weight"),
        ]
        if hf.get("tie_word_embeddings", False):
            # The last pipeline stage keeps its own copy of the tied embedding: load, never export.
            rules.append(ColumnParallel("output_layer.weight", "model.embed_tokens.weight", "tp",
                                        export=False))
        else:
            rules.append(ColumnParallel("output_layer.weight", "lm_head.weight", "tp"))
        qkv_hf = [f"{H}.self_attn.{p}_proj.weight" for p in "qkv"]
        rules += [
            # local spec (separate norm module) and Transformer Engine spec (norm fused into linear)
            Replicated(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight"),
            Replicated(f"{L}.self_attention.linear_qkv.layer_norm_weight",
                       f"{H}.input_layernorm.weight"),
            FusedQKV(f"{L}.self_attention.linear_qkv.weight", qkv_hf, dims),
            RowParallel(f"{L}.self_attention.linear_proj.weight", f"{H}.self_attn.o_proj.weight", "tp"),
        ]
        # matches only when the model has a q/k/v bias (Qwen2, attention_bias=true)
        rules.append(FusedQKV(f"{L}.self_attention.linear_qkv.bias",
                              [f"{H}.self_attn.{p}_proj.bias" for p in "qkv"], dims))
        if self.qk_norm:
            rules += [
                Replicated(f"{L}.self_attention.q_layernorm.weight", f"{H}.self_attn.q_norm.weight"),
                Replicated(f"{L}.self_attention.k_layernorm.weight", f"{H}.self_attn.k_norm.weight"),
            ]
        rules += [
            Replicated(f"{L}.pre_mlp_layernorm.weight", f"{H}.post_attention_layernorm.weight"),
            Replicated(f"{L}.mlp.linear_fc1.layer_norm_weight", f"{H}.post_attention_layernorm.weight"),
            GatedFC1(f"{L}.mlp.linear_fc1.weight",
                     [f"{H}.mlp.gate_proj.weight", f"{H}.mlp.up_proj.weight"], "tp"),
            RowParallel(f"{L}.mlp.linear_fc2.weight", f"{H}.mlp.down_proj.weight", "tp"),
        ]
        if self.expert_hf is not None:
            gate, up, down = (f"{H}.{p}" for p in self.expert_hf)
            rules.append(Replicated(f"{L}.mlp.router.weight", f"{H}.{self.router_hf}"))
            for fc1, fc2 in (
                (f"{L}.mlp.experts.local_experts.*.linear_fc1.weight",
                 f"{L}.mlp.experts.local_experts.*.linear_fc2.weight"),  # SequentialMLP (local)
                (f"{L}.mlp.experts.linear_fc1.weight*", f"{L}.mlp.experts.linear_fc2.weight*"),  # TE grouped
            ):
                rules += [GatedFC1(fc1, [gate, up], "etp"), RowParallel(fc2, down, "etp")]
        rules += self.extra_rules(hf)
        return MappingRegistry(rules)


def attention_dims(hf: dict) -> AttentionDims:
    heads = hf["num_attention_heads"]
    return AttentionDims(
        num_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
    )


def common_config_fields(hf: dict) -> dict:
    """TransformerConfig kwargs shared by the Llama-style families."""
    rope_scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if isinstance(rope_scaling, dict):
        kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if kind not in (None, "default"):
            raise ValueError(f"config.json rope_scaling type {kind!r} is not supported yet")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {hf.get('hidden_act')!r} is not supported (silu only)")
    dims = attention_dims(hf)
    return dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=dims.num_heads,
        num_query_groups=dims.num_query_groups,
        kv_channels=dims.head_dim,
        ffn_hidden_size=hf.get("intermediate_size"),
        normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def rope_theta(hf: dict) -> float:
    if "rope_theta" in hf:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", 10000.0))


def moe_layer_pattern(hf: dict) -> list[int] | int:
    """Megatron's moe_layer_freq from HF's decoder_sparse_step / mlp_only_layers."""
    n = hf["num_hidden_layers"]
    step = hf.get("decoder_sparse_step", 1) or 1
    dense = set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
    return 1 if all(pattern) else pattern


_FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    for arch in family.architectures:
        _FAMILIES[arch] = family
    return family


def get_family(hf: dict) -> ModelFamily:
    """The family for config.json's ``architectures`` (or ``model_type``). Raises ValueError naming
    the architecture and the supported ones."""
    import gspo_megatron.models.mixtral  # noqa: F401  (registration side effects)
    import gspo_megatron.models.qwen2  # noqa: F401
    import gspo_megatron.models.qwen3  # noqa: F401
    import gspo_megatron.models.qwen3_moe  # noqa: F401

    archs = list(hf.get("architectures") or [])
    for arch in archs:
        if arch in _FAMILIES:
            return _FAMILIES[arch]
    by_type = {f.name: f for f in _FAMILIES.values()}
    if hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    supported = ", ".join(sorted(_FAMILIES))
    raise ValueError(
        f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; "
        f"supported: {supported}")
