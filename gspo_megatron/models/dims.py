"""The dimensions of a decoder-only (MoE) transformer that the planner and the layout checks need,
normalized across families. Each family fills one from its HF config (``ModelFamily.dims``); the
planner's formulas read only these fields, never an architecture name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    model_type: str
    vocab_size: int
    hidden: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden: int  # dense MLP intermediate size (layers without experts)
    moe_ffn_hidden: int  # one routed expert's intermediate size (0 without experts)
    num_experts: int
    topk: int
    moe_layers: tuple[int, ...]
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    tie_embeddings: bool
    max_position_embeddings: int
    rope_type: str = "default"
    shared_expert_ffn: int = 0  # intermediate size of the shared expert(s) of an MoE layer, summed
    shared_expert_gate: bool = False  # a sigmoid gate [1, hidden] on the shared expert
    # multi-latent attention (DeepSeek); kv_lora_rank == 0 means grouped-query attention
    q_lora_rank: int = 0  # 0: queries projected directly (no low-rank q)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # gpt-oss: biases on every expert's fc1 (2 * moe_ffn_hidden) and fc2 (hidden), a router bias
    # (num_experts), one attention-sink logit per query head
    expert_bias: bool = False
    router_bias: bool = False
    attention_sinks: bool = False
    # MiniMax-M2: the q/k norm spans all heads (weights [num_heads * head_dim] and
    # [num_kv_heads * head_dim], TP-split with the heads) instead of one [head_dim] weight each
    qk_norm_full_width: bool = False
    # DeepSeek Sparse Attention (DeepSeek-V3.2 / GLM-5): the lightning indexer of every layer (wq_b
    # [H*D, q_lora_rank], wk [D, hidden], k_norm LayerNorm [D] + bias, weights_proj [H, hidden]); 0: none
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_shared_layers: tuple[int, ...] = ()  # DSA layers without an indexer (GLM-5 "shared": reuse a selection)
    # Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): full attention with an output gate (q_proj twice as
    # wide); the layers in ``linear_layers`` are Gated DeltaNet instead: in_proj [2*Hk*dk + 2*Hv*dv + 2*Hv,
    # hidden], conv1d [2*Hk*dk + Hv*dv, 1, K], dt_bias / A_log [Hv], norm [dv], out_proj [hidden, Hv*dv];
    # recurrent state per sequence Hv * dk * dv (fp32) plus the conv history (K - 1) * conv channels
    attention_output_gate: bool = False
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - len(self.moe_layers)

    @property
    def q_size(self) -> int:
        """Query width: heads * head_dim (MLA: heads * (nope + rope))."""
        if self.mla:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Key (= value for GQA) width: kv heads * head_dim (MLA: the up-projected keys)."""
        if self.mla:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, hf: dict) -> "ModelDims":
        """The family's dims for a config.json dict, after the family's own checks (ValueError naming
        the field, or the model_type and the supported ones)."""
        from gspo_megatron.models.registry import get_family

        family = get_family(hf)
        family.check(hf)
        return family.dims(hf)
