"""Qwen3-Next (Qwen/Qwen3-Next-80B-A3B; HF ``model_type`` qwen3_next, transformers' own
``Qwen3NextForCausalLM``): a hybrid of Gated DeltaNet linear attention (``linear_attn``) and gated
full attention (``self_attn``), chosen per layer by ``layer_types`` (transformers 5.x) or
``full_attention_interval`` (every N-th layer full; the published config.json), with

- gated full attention: ``q_proj`` gives per head a query and an output gate,
  ``o = o_proj(attn(q, k, v) * sigmoid(gate))`` (Megatron's ``attention_output_gate``), per-head q/k
  RMSNorm, partial rotary (``partial_rotary_factor``: rotate-half on the first quarter of each head:
  Megatron's ``rotary_percent``);
- Gated DeltaNet layers (``hybrid_spec.PackedGatedDeltaNet``, kernels in ``kernels.py``);
- zero-centered RMSNorms ``x / rms(x) * (1 + w)`` everywhere except the Gated DeltaNet output norm;
- routed experts (softmax top-k, renormalized) and a shared expert scaled by ``sigmoid(x @ g^T)``
  (Megatron's ``SharedExpertMLP`` with ``moe_shared_expert_gate``), as Qwen2-MoE.

The multi-token-prediction layer of the published checkpoint (``mtp.*``: ``mtp_num_hidden_layers``) is not
part of transformers' model. It is the speculative draft sglang 0.5.23 serves (``Qwen3NextForCausalLMMTP``,
``srt/models/qwen3_next_mtp.py``) and, with ``model.mtp``, a trained part of the Megatron model
(``models/mtp.py``: :data:`~gspo_megatron.models.mtp.MTP_BRANCH` names, a full-attention MoE layer:
``hybrid_spec.mtp_layer_spec``); otherwise carried unchanged (``models/carried.py``).
"""

from __future__ import annotations

from dataclasses import replace

from gspo_megatron.models import hf_config
from gspo_megatron.models.dims import ModelDims
from gspo_megatron.models.family import GQAFamily
from gspo_megatron.models.mapping import ColumnParallel, MappingRegistry, Replicated, RowParallel, Rule
from gspo_megatron.models.mtp_naming import MTP_BRANCH
from gspo_megatron.models.qwen3_next.rules import GatedFusedQKV, GDNConv, GDNDims, GDNInProj
from gspo_megatron.models.registry import register_family
from gspo_megatron.models.rules import (
    ExpertNaming,
    H,
    L,
    attention_dims,
    dense_mlp_rules,
    embedding_rules,
    pre_mlp_norm_rules,
    routed_expert_rules,
    shared_expert_rules,
)

# Published config.json of Qwen/Qwen3-Next-80B-A3B-Instruct (transformers 4.57 spelling). The hub file is not
# reachable from here; each value names the public copies it was checked against:
#   slime80: THUDM/slime scripts/models/qwen3-next-80B-A3B.sh (Megatron architecture arguments: 48 layers,
#     hidden 2048, ffn 5120, 16 heads / 2 kv groups of 256, rotary percent 0.25 and base 10000000, norm eps 1e-6,
#     vocab 151936, untied, 512 experts top-10 of 512 with a gated shared expert of 512, MTP 1 layer);
#   qcn: a transcription of the Qwen3-Coder-Next release's config.json in a public C++ loader test (found by
#     find_string '"model_type": "qwen3_next",'; the index names no repository): the same Qwen3NextForCausalLM
#     schema and shapes field for field, with rope_theta 5000000 which that test calls "half the 80B's theta";
#   tf523: transformers 5.23 Qwen3NextConfig defaults (its docstring checkpoint is Qwen/Qwen3-Next-80B-A3B-Instruct;
#     intermediate_size 5632 and max_position_embeddings 32768 there are class defaults, not the checkpoint's).
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],  # qcn
    "attention_bias": False,  # qcn, tf523
    "attention_dropout": 0.0,  # qcn
    "bos_token_id": 151643,  # qcn
    "decoder_sparse_step": 1,  # qcn, tf523
    "eos_token_id": 151645,  # qcn
    "full_attention_interval": 4,  # qcn
    "head_dim": 256,  # qcn, slime80 --kv-channels
    "hidden_act": "silu",  # qcn, slime80 --swiglu
    "hidden_size": 2048,  # qcn, slime80
    "initializer_range": 0.02,  # qcn, tf523
    "intermediate_size": 5120,  # qcn, slime80 --ffn-hidden-size (unused: every layer is MoE)
    "linear_conv_kernel_dim": 4,  # qcn, tf523
    "linear_key_head_dim": 128,  # qcn, tf523
    "linear_num_key_heads": 16,  # qcn, tf523
    "linear_num_value_heads": 32,  # qcn, tf523
    "linear_value_head_dim": 128,  # qcn, tf523
    "max_position_embeddings": 262144,  # qcn
    "mlp_only_layers": [],  # qcn
    "model_type": "qwen3_next",  # qcn
    "moe_intermediate_size": 512,  # qcn, slime80 --moe-ffn-hidden-size
    "mtp_num_hidden_layers": 1,  # slime80 --mtp-num-layers 1 (the mtp.* layer: models/mtp.py)
    "norm_topk_prob": True,  # qcn, tf523
    "num_attention_heads": 16,  # qcn, slime80
    "num_experts": 512,  # qcn, slime80
    "num_experts_per_tok": 10,  # qcn, slime80 --moe-router-topk
    "num_hidden_layers": 48,  # qcn, slime80
    "num_key_value_heads": 2,  # qcn, slime80 --num-query-groups
    "output_router_logits": False,  # qcn
    "partial_rotary_factor": 0.25,  # qcn, slime80 --rotary-percent
    "rms_norm_eps": 1e-06,  # qcn, slime80 --norm-epsilon
    "rope_scaling": None,  # qcn
    "rope_theta": 10000000,  # slime80 --rotary-base; twice qcn's 5000000, as qcn states for the 80B
    "router_aux_loss_coef": 0.001,  # qcn, tf523
    "shared_expert_intermediate_size": 512,  # qcn, slime80 --moe-shared-expert-intermediate-size
    "tie_word_embeddings": False,  # qcn, slime80 --untie-embeddings-and-output-weights
    "torch_dtype": "bfloat16",  # qcn spells it "dtype" (transformers >= 4.56 writes dtype); same value
    "use_cache": True,  # qcn
    "use_sliding_window": False,  # qcn
    "vocab_size": 151936,  # qcn, slime80
}

LAYER_TYPES = ("linear_attention", "full_attention")


def linear_attention_pattern(hf: dict) -> list[int]:
    """1 for each Gated DeltaNet layer, 0 for each full-attention layer: ``layer_types`` when present,
    else every ``full_attention_interval``-th layer (default 4) is full attention."""
    n = hf_config.get_int(hf, "num_hidden_layers")
    types = hf.get("layer_types")
    if types:
        if len(types) != n or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"config.json layer_types must list {n} entries of {'/'.join(LAYER_TYPES)}, got {types!r}")
        return [int(t == "linear_attention") for t in types]
    every = int(hf.get("full_attention_interval") or 4)
    return [int((i + 1) % every != 0) for i in range(n)]


def gdn_dims(hf: dict) -> GDNDims:
    g = hf_config.get_int
    return GDNDims(
        key_heads=g(hf, "linear_num_key_heads"),
        value_heads=g(hf, "linear_num_value_heads"),
        key_dim=g(hf, "linear_key_head_dim"),
        value_dim=g(hf, "linear_value_head_dim"),
    )


def hybrid_attention_rules(
    hf: dict, packed_in_proj: bool, in_proj: tuple[str, ...], linear: str = "linear_attn", conv_bias: bool = False
) -> list[Rule]:
    """Both token mixers of a hybrid layer (a layer holds one or the other; a rule whose Megatron name
    the layer lacks never resolves): gated full attention and Gated DeltaNet (``rules.py``)."""
    dims, gdn = attention_dims(hf), gdn_dims(hf)
    a, la = f"{L}.self_attention", f"{H}.{linear}"
    rules: list[Rule] = [
        Replicated(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight"),
        Replicated(f"{a}.linear_qkv.layer_norm_weight", f"{H}.input_layernorm.weight"),
        GatedFusedQKV(f"{a}.linear_qkv.weight", [f"{H}.self_attn.{p}_proj.weight" for p in "qkv"], dims),
        RowParallel(f"{a}.linear_proj.weight", f"{H}.self_attn.o_proj.weight", "tp"),
        Replicated(f"{a}.q_layernorm.weight", f"{H}.self_attn.q_norm.weight"),
        Replicated(f"{a}.k_layernorm.weight", f"{H}.self_attn.k_norm.weight"),
        Replicated(f"{a}.in_proj.layer_norm_weight", f"{H}.input_layernorm.weight"),
        GDNInProj(f"{a}.in_proj.weight", [f"{la}.{p}.weight" for p in in_proj], gdn, packed=packed_in_proj),
        GDNConv(f"{a}.conv1d.weight", f"{la}.conv1d.weight", gdn),
        ColumnParallel(f"{a}.dt_bias", f"{la}.dt_bias", "tp"),
        ColumnParallel(f"{a}.A_log", f"{la}.A_log", "tp"),
        Replicated(f"{a}.out_norm.weight", f"{la}.norm.weight"),
        RowParallel(f"{a}.out_proj.weight", f"{la}.out_proj.weight", "tp"),
    ]
    if conv_bias:
        rules.append(GDNConv(f"{a}.conv1d.bias", f"{la}.conv1d.bias", gdn))
    return rules


@register_family
class Qwen3Next(GQAFamily):
    name = "qwen3_next"
    architectures: tuple[str, ...] = ("Qwen3NextForCausalLM",)
    sglang_modules = {"Qwen3NextForCausalLM": "qwen3_next"}
    sglang_draft_modules = {"Qwen3NextForCausalLMMTP": "qwen3_next_mtp"}
    mtp_trainable = True
    mtp_naming = MTP_BRANCH
    sglang_mamba_cache = True  # Gated DeltaNet layers: sglang's class keeps a Mamba-style state cache
    expert_naming = ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj")
    shared_expert_block = "mlp.shared_expert"
    shared_expert_gate = "mlp.shared_expert_gate.weight"
    qk_norm = True
    fp8_modules = GQAFamily.fp8_modules + ("in_proj_qkvz", "out_proj")
    fp8_excluded = GQAFamily.fp8_excluded + ("shared_expert_gate", "in_proj_ba", "conv1d")
    sglang_every_layer_sparse = True  # sglang's Qwen3NextSparseMoeBlock in every layer (is_layer_sparse = True)
    in_proj_names: tuple[str, ...] = ("in_proj_qkvz", "in_proj_ba")
    tiny = dict(
        architectures=["Qwen3NextForCausalLM"],
        vocab_size=256,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.25,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        full_attention_interval=2,  # what sglang reads (it ignores layer_types); transformers keeps both
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=24,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    published = {"qwen3-next-80b-a3b": QWEN3_NEXT_80B}

    # -- checks -----------------------------------------------------------------------------------
    def check(self, hf: dict) -> None:
        super().check(hf)
        if hf_config.rope_type(hf) != "default":
            raise ValueError(
                f"config.json rope type {hf_config.rope_type(hf)!r} with partial rotary is not supported "
                f"for {self.name} (default RoPE only)"
            )
        linear_attention_pattern(hf)
        g = gdn_dims(hf)
        if g.value_heads % g.key_heads:
            raise ValueError(
                f"config.json linear_num_value_heads ({g.value_heads}) must be a multiple of "
                f"linear_num_key_heads ({g.key_heads})"
            )

    def tp_divisible(self, hf: dict) -> list[tuple[str, int]]:
        g = gdn_dims(hf)
        return [("linear_num_key_heads", g.key_heads), ("linear_num_value_heads", g.value_heads)]

    def sglang_errors(self, hf: dict) -> list[str]:
        """sglang 0.5.23 (``configs/qwen3_next.py`` ``layers_block_type``) places the full-attention layers by
        ``full_attention_interval`` alone (default 4) and ignores ``layer_types``."""
        e = super().sglang_errors(hf)
        every = int(hf.get("full_attention_interval") or 4)
        want = [int((i + 1) % every != 0) for i in range(hf_config.get_int(hf, "num_hidden_layers"))]
        if linear_attention_pattern(hf) != want:
            e.append(
                f"config.json layer_types={hf.get('layer_types')!r} is not supported with rollout.engine=sglang "
                f"for {self.name}: sglang's {self.architectures[0]} places full attention at every "
                f"full_attention_interval-th layer ({every}); use that pattern, or rollout.engine=hf"
            )
        return e

    def randomize_tiny(self, model) -> None:
        import torch

        for name, p in model.named_parameters():
            if name.endswith(("dt_bias", "A_log")):
                p.copy_(torch.randn_like(p) * 0.5)

    # -- Megatron config --------------------------------------------------------------------------
    def config_fields(self, hf: dict) -> dict:
        fields = super().config_fields(hf)
        g = gdn_dims(hf)
        fields.update(
            attention_output_gate=True,
            qk_layernorm=True,
            layernorm_zero_centered_gamma=True,
            linear_attention_freq=linear_attention_pattern(hf),
            linear_conv_kernel_dim=hf_config.get_int(hf, "linear_conv_kernel_dim"),
            linear_key_head_dim=g.key_dim,
            linear_value_head_dim=g.value_dim,
            linear_num_key_heads=g.key_heads,
            linear_num_value_heads=g.value_heads,
        )
        return fields

    def adapt_layer_spec(self, block_spec, te: bool) -> None:
        from gspo_megatron.models.qwen3_next.hybrid_spec import use_hybrid_layers

        use_hybrid_layers(block_spec, te)

    def adapt_mtp_layer_spec(self, layer_spec, te: bool):
        from gspo_megatron.models.qwen3_next.hybrid_spec import mtp_layer_spec

        return mtp_layer_spec(layer_spec, te)

    # -- weights ----------------------------------------------------------------------------------
    def mapping(self, hf: dict) -> MappingRegistry:
        rules = embedding_rules(hf) + hybrid_attention_rules(hf, len(self.in_proj_names) == 2, self.in_proj_names)
        rules += pre_mlp_norm_rules() + dense_mlp_rules() + routed_expert_rules(self.expert_naming)
        rules += shared_expert_rules(self.shared_expert_block, self.shared_expert_gate)
        return MappingRegistry(rules)

    # -- planner ----------------------------------------------------------------------------------
    def dims(self, hf: dict) -> ModelDims:
        g = gdn_dims(hf)
        pattern = linear_attention_pattern(hf)
        return replace(
            super().dims(hf),
            attention_output_gate=True,
            linear_layers=tuple(i for i, x in enumerate(pattern) if x),
            linear_key_heads=g.key_heads,
            linear_value_heads=g.value_heads,
            linear_key_dim=g.key_dim,
            linear_value_dim=g.value_dim,
            linear_conv_kernel=hf_config.get_int(hf, "linear_conv_kernel_dim"),
        )
