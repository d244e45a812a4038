"""Shared building blocks of the declarative weight mappings (one helper per layer part).

A family's ``mapping(hf)`` is a concatenation of these. Megatron names are the *global* names of the
GPTModel (``decoder.layers.<layer>...``; ``weights.py`` translates local ones); ``*`` is the layer,
the second ``*`` the expert. Each part lists the names of both Megatron layer specs: the local spec
(separate norm modules, SequentialMLP experts ``local_experts.<e>``) and Transformer Engine's (norm
fused into the next linear as ``layer_norm_weight``, grouped experts ``linear_fc1.weight<e>``); a rule
whose Megatron name does not occur in the built model is never resolved. A parameter the two specs
name alike but shard differently (MLA's down projections) has one rule per spec (``Rule.spec``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from gspo_megatron.models import hf_config
from gspo_megatron.models.mapping import (
    AttentionDims,
    ColumnParallel,
    FusedQKV,
    FuseGroup,
    GatedFC1,
    PermutedRows,
    Replicated,
    RowParallel,
    Rule,
    StackedExpertFC1,
    StackedExpertFC2,
    StackedExpertReplicated,
)

L = "decoder.layers.*"  # Megatron layer prefix
H = "model.layers.*"  # HF layer prefix


@dataclass(frozen=True)
class ExpertNaming:
    """How a family names one routed expert's weights in the HF *checkpoint*:
    ``model.layers.<l>.{block}.experts.<e>.{gate|up|down}.weight``, and its router ``{block}.{router}``.
    transformers 5.x keeps these experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]); the CPU engine (engines/hf_engine.py) maps between the two."""

    block: str
    gate: str
    up: str
    down: str
    router: str = "gate.weight"

    def weight_of(self, name: str) -> tuple[int, str] | None:
        """(expert, ``"gate" | "up" | "down"``) when checkpoint tensor ``name`` is one routed expert's
        weight in this naming (``...{block}.experts.<e>.{gate|up|down}.weight``), else None. HF
        linear weights are [out, in]: the intermediate dimension is dim 0 of gate / up, dim 1 of down."""
        m = _expert_weight_re(self).search(name)
        if m is None:
            return None
        role = "gate" if m.group("proj") == self.gate else "up" if m.group("proj") == self.up else "down"
        return int(m.group("e")), role


@functools.lru_cache(maxsize=None)
def _expert_weight_re(naming: ExpertNaming) -> re.Pattern[str]:
    projs = "|".join(re.escape(p) for p in (naming.gate, naming.up, naming.down))
    return re.compile(rf"\.{re.escape(naming.block)}\.experts\.(?P<e>\d+)\.(?P<proj>{projs})\.weight$")


@dataclass(frozen=True)
class StackedExpertNaming:
    """How a family names routed experts stacked per layer in the HF checkpoint (gpt-oss, under the
    names transformers keeps in memory): ``{block}.experts.{gate_up}`` [E, H, 2I] (gate / up
    interleaved on the last dim) + ``{gate_up}{bias}`` [E, 2I], ``{block}.experts.{down}`` [E, I, H]
    + ``{down}{bias}`` [E, H]."""

    block: str
    gate_up: str
    down: str
    bias: str = "_bias"

    def tensor_of(self, name: str) -> tuple[str, bool] | None:
        """(``gate_up`` or ``down`` projection, whether it is the bias) when checkpoint tensor ``name``
        is one of this naming's stacked expert tensors, else None."""
        for proj in (self.gate_up, self.down):
            for is_bias, suffix in ((False, ""), (True, self.bias)):
                if name.endswith(f".{self.block}.experts.{proj}{suffix}"):
                    return proj, is_bias
        return None

    def intermediate_dim(self, name: str) -> int | None:
        """The dimension of stacked tensor ``name`` that holds the intermediate size (what expert
        tensor parallelism cuts): 2 of ``gate_up``, 1 of its bias and of ``down``; None for ``down``'s
        bias [E, H], which has none. Raises ValueError for a name this naming does not hold."""
        found = self.tensor_of(name)
        if found is None:
            raise ValueError(f"{name} is not a stacked expert tensor of {self}")
        proj, is_bias = found
        if proj == self.down:
            return None if is_bias else 1
        return 1 if is_bias else 2


def attention_dims(hf: dict) -> AttentionDims:
    return AttentionDims(
        num_heads=hf_config.num_heads(hf), num_query_groups=hf_config.num_kv_heads(hf), head_dim=hf_config.head_dim(hf)
    )


def embedding_rules(hf: dict) -> list[Rule]:
    """Input embedding (vocab-parallel), final norm, output layer (tied: loaded, never exported)."""
    rules: list[Rule] = [
        ColumnParallel("embedding.word_embeddings.weight", "model.embed_tokens.weight", "tp"),
        Replicated("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if hf.get("tie_word_embeddings", False):
        # The last pipeline stage keeps its own copy of the tied embedding: load, never export.
        rules.append(ColumnParallel("output_layer.weight", "model.embed_tokens.weight", "tp", export=False))
    else:
        rules.append(ColumnParallel("output_layer.weight", "lm_head.weight", "tp"))
    return rules


def gqa_attention_rules(hf: dict, qk_norm: bool = False) -> list[Rule]:
    """Grouped-query attention: input norm, fused QKV (weight, and bias when the checkpoint has one),
    output projection, optional per-head q/k RMSNorm (Qwen3)."""
    dims = attention_dims(hf)
    rules: list[Rule] = [
        Replicated(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight"),
        Replicated(f"{L}.self_attention.linear_qkv.layer_norm_weight", f"{H}.input_layernorm.weight"),
        FusedQKV(f"{L}.self_attention.linear_qkv.weight", [f"{H}.self_attn.{p}_proj.weight" for p in "qkv"], dims),
        FusedQKV(f"{L}.self_attention.linear_qkv.bias", [f"{H}.self_attn.{p}_proj.bias" for p in "qkv"], dims),
        RowParallel(f"{L}.self_attention.linear_proj.weight", f"{H}.self_attn.o_proj.weight", "tp"),
    ]
    if qk_norm:
        rules += [
            Replicated(f"{L}.self_attention.q_layernorm.weight", f"{H}.self_attn.q_norm.weight"),
            Replicated(f"{L}.self_attention.k_layernorm.weight", f"{H}.self_attn.k_norm.weight"),
        ]
    return rules


def pre_mlp_norm_rules(hf_norm: str = "post_attention_layernorm") -> list[Rule]:
    """The norm before the MLP / MoE block (local spec: its own module; TE dense spec: fused into fc1)."""
    return [
        Replicated(f"{L}.pre_mlp_layernorm.weight", f"{H}.{hf_norm}.weight"),
        Replicated(f"{L}.mlp.linear_fc1.layer_norm_weight", f"{H}.{hf_norm}.weight"),
    ]


def dense_mlp_rules(
    block: str = "mlp", gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
) -> list[Rule]:
    """A gated (SwiGLU) dense MLP: fc1 = [gate; up] column-parallel, fc2 row-parallel over TP."""
    return [
        GatedFC1(f"{L}.mlp.linear_fc1.weight", [f"{H}.{block}.{gate}.weight", f"{H}.{block}.{up}.weight"], "tp"),
        RowParallel(f"{L}.mlp.linear_fc2.weight", f"{H}.{block}.{down}.weight", "tp"),
    ]


def routed_expert_rules(naming: ExpertNaming) -> list[Rule]:
    """The router (replicated) and the routed experts (expert-tensor-parallel), per-expert HF tensors."""
    gate, up, down = (f"{H}.{naming.block}.experts.*.{p}.weight" for p in (naming.gate, naming.up, naming.down))
    rules: list[Rule] = [Replicated(f"{L}.mlp.router.weight", f"{H}.{naming.block}.{naming.router}")]
    for fc1, fc2 in (
        (
            f"{L}.mlp.experts.local_experts.*.linear_fc1.weight",
            f"{L}.mlp.experts.local_experts.*.linear_fc2.weight",
        ),  # SequentialMLP (local spec)
        (f"{L}.mlp.experts.linear_fc1.weight*", f"{L}.mlp.experts.linear_fc2.weight*"),  # TE grouped GEMM
    ):
        rules += [GatedFC1(fc1, [gate, up], "etp"), RowParallel(fc2, down, "etp")]
    return rules


def shared_expert_rules(block: str, gate_weight: str | None = None) -> list[Rule]:
    """Megatron's SharedExpertMLP (TP-sharded like a dense MLP) from ``{block}.{gate,up,down}_proj``;
    ``gate_weight``: HF name (under the layer) of its sigmoid gate [1, hidden], when it has one."""
    rules: list[Rule] = [
        GatedFC1(
            f"{L}.mlp.shared_experts.linear_fc1.weight",
            [f"{H}.{block}.gate_proj.weight", f"{H}.{block}.up_proj.weight"],
            "tp",
        ),
        RowParallel(f"{L}.mlp.shared_experts.linear_fc2.weight", f"{H}.{block}.down_proj.weight", "tp"),
    ]
    if gate_weight:
        rules.append(Replicated(f"{L}.mlp.shared_experts.gate_weight", f"{H}.{gate_weight}"))
    return rules


def _interleave(rope: int) -> list[int]:
    """HF rows (x0, ..., x_{d/2-1}, y0, ..., y_{d/2-1}) -> (x0, y0, x1, y1, ...). Megatron's MLA RoPE
    first de-interleaves (even rows, then odd rows: DeepSeek's native layout) then applies
    rotate-half RoPE; a checkpoint with ``rope_interleave=false`` is stored interleaved so that this
    de-interleave gives back its rows."""
    half = rope // 2
    return [j for i in range(half) for j in (i, half + i)]


def mla_attention_rules(hf: dict) -> list[Rule]:
    """Multi-latent attention (DeepSeek-V2/V3): Megatron's MLASelfAttention on either layer spec.
    q: ``q_proj`` or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``; kv: ``kv_a_proj_with_mqa``
    ([kv_lora | rope] rows) -> ``kv_a_layernorm`` -> ``kv_b_proj`` (per head [nope | v]); ``o_proj``.
    The down projections ``linear_q_down_proj`` [q_lora, hidden] and ``linear_kv_down_proj``
    [kv_lora + rope, hidden]: the local spec splits their rows over TP (ColumnParallelLinear, gathered
    before the norms: ``spec="local"`` rules); Transformer Engine's spec (megatron-core 0.16.1
    ``get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True)``: ``backend.linear()``,
    which ``MLASelfAttention`` builds as ``TELinear(parallel_mode="duplicated")``) keeps them whole on
    every TP rank (``spec="te"``: loaded whole on every rank, exported from the lowest rank). The
    q / kv norms: their own modules on the local spec (``q_layernorm`` / ``kv_layernorm``), fused on
    TE's into the up projection (``TELayerNormColumnParallelLinear``: ``linear_q_up_proj.layer_norm_weight``
    [q_lora], ``linear_kv_up_proj.layer_norm_weight`` [kv_lora]); ``input_layernorm`` is its own
    module (``TENorm``) on both. Megatron's
    MLA RoPE treats the rope rows as interleaved pairs, as transformers does with ``rope_interleave``
    (the default): the rows map as they are; with ``rope_interleave=false`` the rope rows of q (per
    head) and of kv_a are interleaved on load and restored on export (``PermutedRows``)."""
    heads, nope, rope = (
        hf_config.get_int(hf, k) for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim")
    )
    kv_lora = hf_config.get_int(hf, "kv_lora_rank")
    order = list(range(rope)) if hf.get("rope_interleave", True) else _interleave(rope)
    q_perm = torch.tensor(
        [h * (nope + rope) + i for h in range(heads) for i in list(range(nope)) + [nope + j for j in order]]
    )
    kv_perm = torch.tensor(list(range(kv_lora)) + [kv_lora + j for j in order])
    a, kv_a = f"{L}.self_attention", f"{H}.self_attn.kv_a_proj_with_mqa.weight"
    rules: list[Rule] = [
        Replicated(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight"),
        PermutedRows(f"{a}.linear_q_proj.weight", f"{H}.self_attn.q_proj.weight", q_perm),
        ColumnParallel(f"{a}.linear_q_down_proj.weight", f"{H}.self_attn.q_a_proj.weight", "tp", spec="local"),
        Replicated(f"{a}.linear_q_down_proj.weight", f"{H}.self_attn.q_a_proj.weight", spec="te"),
        Replicated(f"{a}.q_layernorm.weight", f"{H}.self_attn.q_a_layernorm.weight"),
        Replicated(f"{a}.linear_q_up_proj.layer_norm_weight", f"{H}.self_attn.q_a_layernorm.weight"),
        PermutedRows(f"{a}.linear_q_up_proj.weight", f"{H}.self_attn.q_b_proj.weight", q_perm),
        PermutedRows(f"{a}.linear_kv_down_proj.weight", kv_a, kv_perm, spec="local"),
        PermutedRows(f"{a}.linear_kv_down_proj.weight", kv_a, kv_perm, parallel=None, spec="te"),
        Replicated(f"{a}.kv_layernorm.weight", f"{H}.self_attn.kv_a_layernorm.weight"),
        Replicated(f"{a}.linear_kv_up_proj.layer_norm_weight", f"{H}.self_attn.kv_a_layernorm.weight"),
        ColumnParallel(f"{a}.linear_kv_up_proj.weight", f"{H}.self_attn.kv_b_proj.weight", "tp"),
        RowParallel(f"{a}.linear_proj.weight", f"{H}.self_attn.o_proj.weight", "tp"),
    ]
    return rules


def mla_fuse_groups(hf: dict) -> list[FuseGroup]:
    """With ``q_lora_rank``, sglang 0.5.23 (``models/deepseek_common/deepseek_weight_loader.py``,
    ``DeepseekV2WeightLoaderMixin.do_load_weights``) loads ``q_a_proj`` and ``kv_a_proj_with_mqa`` into
    one ``fused_qkv_a_proj_with_mqa`` (torch.cat of the two, dim 0) only once both are cached in the
    same ``load_weights`` call; a lone half stays in its call's cache and is dropped without a word.
    The FP8 sync's ``weight_scale_inv`` pair is fused the same way: it is made in the bucket of its
    weight (``weight_sync/fp8_quant.quantize_bucket_fp8``), so grouping the weights groups the scales."""
    if not hf.get("q_lora_rank"):
        return []
    return [
        FuseGroup(
            (f"{H}.self_attn.q_a_proj.weight", f"{H}.self_attn.kv_a_proj_with_mqa.weight"),
            "sglang DeepseekV2WeightLoaderMixin: fused_qkv_a_proj_with_mqa = cat(q_a_proj, "
            "kv_a_proj_with_mqa) within one load_weights call",
        )
    ]


def router_bias_rule(hf_name: str) -> Rule:
    """The router's expert-score correction bias (Megatron buffer ``mlp.router.expert_bias``)."""
    return Replicated(f"{L}.mlp.router.expert_bias", f"{H}.{hf_name}")


def stacked_expert_rules(naming: StackedExpertNaming) -> list[Rule]:
    """Routed experts stored stacked per layer with biases (gpt-oss, ``StackedExpertNaming``):
    ``{block}.experts.gate_up_proj`` [E, H, 2I] (gate/up interleaved on the last dim) +
    ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H] + ``down_proj_bias`` [E, H]; the router
    ``{block}.router`` with a bias. Megatron's local spec (SequentialMLP) holds one fc1/fc2 per expert;
    each rule maps that expert's row of the stacked tensor (``weights.py`` reads just that row, and
    stacks the rows on export)."""
    block = naming.block
    e = f"{H}.{block}.experts"
    x = f"{L}.mlp.experts.local_experts.*"
    return [
        Replicated(f"{L}.mlp.router.weight", f"{H}.{block}.router.weight"),
        Replicated(f"{L}.mlp.router.bias", f"{H}.{block}.router.bias"),
        StackedExpertFC1(f"{x}.linear_fc1.weight", f"{e}.{naming.gate_up}", "etp", transposed=True),
        StackedExpertFC1(f"{x}.linear_fc1.bias", f"{e}.{naming.gate_up}{naming.bias}", "etp", transposed=False),
        StackedExpertFC2(f"{x}.linear_fc2.weight", f"{e}.{naming.down}", "etp"),
        StackedExpertReplicated(f"{x}.linear_fc2.bias", f"{e}.{naming.down}{naming.bias}", "etp"),
    ]


def attention_sink_rule(hf_name: str = "self_attn.sinks") -> Rule:
    """Per-head attention sinks (gpt-oss): Megatron's learnable softmax offset of the core attention
    (``softmax_type="learnable"``), one value per query head, split over TP with the heads."""
    return ColumnParallel(f"{L}.self_attention.core_attention.softmax_offset", f"{H}.{hf_name}", "tp")


def attention_out_bias_rule() -> Rule:
    """The output projection's bias (added once after the row-parallel reduction: replicated)."""
    return Replicated(f"{L}.self_attention.linear_proj.bias", f"{H}.self_attn.o_proj.bias")
