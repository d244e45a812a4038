"""Megatron-Core 0.16.1's local (non-TE) ``DotProductAttention`` does not accept the ``k_channels`` /
``v_channels`` arguments that ``MLASelfAttention`` passes, so MLA cannot be built on the local spec
as shipped. ``MLALocalDotProductAttention`` accepts them: the local kernel already handles a key
width (nope + rope) different from the value width, given that ``config.kv_channels`` is the value
head dim (it sizes the output) and the softmax scale comes from MLA (``softmax_scale``, with YaRN's
mscale; the generic Attention constructor first builds one without it, which MLA then replaces).
Without Transformer Engine the MLA module also misreads TE as present (``HAVE_TE``); corrected here. ``use_local_mla_attention(block_spec)`` puts it into every MLA layer of a decoder block spec.

Megatron-Core 0.16.1 fix (its bug, any TP > 1 on the local spec): with ``linear_kv_down_proj`` a
``ColumnParallelLinear`` (the local spec), MLA all-gathers its output over TP along the last dim,
``kv_combined = [kv_compressed | k_pos_emb]`` [s, b, kv_lora_rank + qk_rope_head_dim], and uses the
shared RoPE key ``k_pos_emb`` (full sequence on every rank) in this rank's heads only. The gather's
backward keeps this rank's slice of the gradient, so each rank's ``k_pos_emb`` gradient holds its own
heads' share and the shares of the other ranks' heads are dropped: the key RoPE columns of
``linear_kv_down_proj`` (and everything below them: the input layernorm, earlier layers, the
embedding) get a partial gradient (measured: every gradient 0.2-0.7% off, grad norm rel 1e-3 at TP2).
(The ``kv_compressed`` columns are right: ``linear_kv_up_proj``'s backward sums its input gradient
over TP.) ``LocalMLASelfAttention`` tags ``linear_kv_down_proj``'s output, and MLA's gather of a tagged
tensor sums the ``k_pos_emb`` columns' gradient over TP before keeping this rank's slice
(:class:`_GatherSumRopeKeyGrad`). Transformer Engine's spec (``TELinear`` "duplicated" down
projections, gathered over the sequence with a reduce-scatter backward) does not have the bug.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

_ROPE_TAIL = "_gspo_rope_key_columns"  # attribute on linear_kv_down_proj's output: qk_rope_head_dim


class _GatherSumRopeKeyGrad(torch.autograd.Function):
    """Forward: all-gather ``x`` [..., d / tp] over ``group`` along the last dim (Megatron's gather).
    Backward: all-reduce (sum) the last ``rope`` columns of the gradient [..., d] over ``group`` (each
    rank holds its heads' share of the shared RoPE key's gradient), then keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, rope: int):
        ctx.group, ctx.rope = group, rope
        return mappings._gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        tail = grad[..., -ctx.rope :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.rope :] = tail
        return mappings._split_along_last_dim(grad, ctx.group), None, None


def _gather_last_dim(input_, group=None):
    """MLA's ``gather_from_tensor_model_parallel_region``: the fixed gather for the tagged
    ``linear_kv_down_proj`` output, Megatron's own for everything else (the q down projection)."""
    rope = getattr(input_, _ROPE_TAIL, 0)
    if not rope:
        return mappings.gather_from_tensor_model_parallel_region(input_, group)
    group = mappings.get_tensor_model_parallel_group_if_none(group)
    if group.size() == 1:
        return input_
    return _GatherSumRopeKeyGrad.apply(input_, group, rope)


def _tag_kv_down_output(module, args, output):
    setattr(output[0], _ROPE_TAIL, module._gspo_rope_dim)


class LocalMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose ``linear_kv_down_proj`` output is tagged for :func:`_gather_last_dim`
    (module docstring: the RoPE key gradient under TP). Same parameters, same forward values."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.linear_kv_down_proj._gspo_rope_dim = config.qk_pos_emb_head_dim
        self.linear_kv_down_proj.register_forward_hook(_tag_kv_down_output)


class MLALocalDotProductAttention(DotProductAttention):
    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(
                f"MLA local attention needs config.kv_channels == v_head_dim ({config.kv_channels} != {v_channels})"
            )
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout,
            softmax_scale,
            cp_comm_type,
            pg_collection,
        )


def use_local_mla_attention(block_spec) -> None:
    """Every MLA layer of ``block_spec`` (in place): ``LocalMLASelfAttention`` with the local core attention."""
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):
        # Without Transformer Engine Megatron's TE extension hands out mock classes, yet the module
        # believes it has TE and calls isinstance(linear_proj, TELinear): correct the flag.
        mla.HAVE_TE = False
    # MLA's module-level name only (the module docstring: the RoPE key gradient under TP)
    mla.gather_from_tensor_model_parallel_region = _gather_last_dim
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        if attn.module in (MLASelfAttention, LocalMLASelfAttention):
            attn.module = LocalMLASelfAttention
            if attn.submodules.core_attention is DotProductAttention:
                attn.submodules.core_attention = MLALocalDotProductAttention
