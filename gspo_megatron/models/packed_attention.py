"""Packed (THD) sequences for Megatron-Core's local attention: causal attention segment by segment.

Megatron-Core 0.16.1's local ``DotProductAttention`` refuses ``packed_seq_params`` (only Transformer
Engine implements THD). ``PackedDotProductAttention`` accepts them with TE's semantics: with
``qkv_format == "thd"`` the attention module hands it query/key/value [t, heads, dim] (rotary
embeddings already applied per segment by Megatron-Core's THD path, positions restarting at each
``cu_seqlens`` boundary); it runs the unchanged causal attention on each segment
cu_seqlens[k]..cu_seqlens[k+1] alone (batch 1) and concatenates the outputs, so no token attends
across a segment boundary. That is exactly a block-diagonal causal mask over the packed row, at the
cost sum_k L_k^2 of TE's THD kernel instead of T^2. Output [t, 1, heads*dim]; the attention module
reshapes it as it does TE's THD output.

``use_packed_local_attention(block_spec)`` puts it into a local layer spec (every rank, at build time),
also into a family's own subclass of the local attention (e.g. DeepSeek-V3's MLA one).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


def packed_cu_seqlens(packed_seq_params) -> torch.Tensor:
    """The sequence boundaries [n + 1] of a THD packed row (the padded ones when the packer set them);
    ValueError for any other qkv_format."""
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"packed sequences need qkv_format='thd', got {packed_seq_params.qkv_format!r}")
    cu = packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q if cu is None else cu


def packed_bounds(packed_seq_params, tokens: int) -> list[int]:
    """:func:`packed_cu_seqlens` as a list, checked to span exactly the row's ``tokens``."""
    cu = packed_cu_seqlens(packed_seq_params).tolist()
    if cu[0] != 0 or cu[-1] != tokens:
        raise ValueError(f"cu_seqlens span {cu[0]}..{cu[-1]} but the packed row has {tokens} tokens")
    return cu


class PackedAttentionMixin:
    """Adds THD ``packed_seq_params`` to a local ``DotProductAttention`` class (module docstring)."""

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        base = super()
        if packed_seq_params is None:
            return base.forward(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias
            )
        cu = packed_bounds(packed_seq_params, query.shape[0])
        outs = [
            base.forward(
                query[a:b].unsqueeze(1),
                key[a:b].unsqueeze(1),
                value[a:b].unsqueeze(1),
                None,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
            )
            for a, b in zip(cu[:-1], cu[1:])
            if b > a
        ]
        return torch.cat(outs, dim=0)  # [t, 1, heads*dim]


class PackedDotProductAttention(PackedAttentionMixin, DotProductAttention):
    """Megatron-Core's local attention, also taking THD ``packed_seq_params``."""


_PACKED: dict[type, type] = {DotProductAttention: PackedDotProductAttention}


def packed_variant(cls: type) -> type:
    """The packed-capable subclass of a local attention class (``DotProductAttention`` or a subclass
    of it, e.g. a family's own local MLA attention); created once per class."""
    if issubclass(cls, PackedAttentionMixin):
        return cls
    if cls not in _PACKED:
        _PACKED[cls] = type(f"Packed{cls.__name__}", (PackedAttentionMixin, cls), {"__module__": __name__})
    return _PACKED[cls]


def use_packed_local_attention(block_spec) -> int:
    """Replace every local core attention class (``DotProductAttention`` and its subclasses) in the
    layer specs of a decoder block spec by its packed variant (in place). Returns how many."""
    n = 0
    for layer in getattr(block_spec, "layer_specs", None) or [block_spec]:
        attn = getattr(getattr(layer, "submodules", None), "self_attention", None)
        sub = getattr(attn, "submodules", None)
        core = getattr(sub, "core_attention", None)
        if sub is not None and isinstance(core, type) and issubclass(core, DotProductAttention):
            sub.core_attention = packed_variant(core)
            n += 1
        elif (
            core is not None
            and isinstance(getattr(core, "module", None), type)
            and issubclass(core.module, DotProductAttention)
        ):
            core.module = packed_variant(core.module)  # a ModuleSpec
            n += 1
    return n
