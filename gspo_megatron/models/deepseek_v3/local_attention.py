"""Megatron-Core 0.16.1's local (non-TE) ``DotProductAttention`` does not accept the ``k_channels`` /
``v_channels`` arguments that ``MLASelfAttention`` passes, so MLA cannot be built on the local spec
as shipped. ``MLALocalDotProductAttention`` accepts them: the local kernel already handles a key
width (nope + rope) different from the value width, given that ``config.kv_channels`` is the value
head dim (it sizes the output) and the softmax scale comes from MLA (``softmax_scale``, with YaRN's
mscale; the generic Attention constructor first builds one without it, which MLA then replaces).
``use_local_mla_attention(block_spec)`` puts it, and ``LocalMLASelfAttention``, into every MLA layer
of a decoder block spec. Megatron-Core's modules are left as they are (no module attribute is
reassigned for the process).

Without Transformer Engine the MLA module misreads TE as present: Megatron's TE extension hands out
mock classes, so ``multi_latent_attention.HAVE_TE`` is True and ``MultiLatentAttention.__init__``
calls ``isinstance(linear_proj, TELinear)`` on a mock (TypeError). ``LocalMLASelfAttention`` clears
the flag for its own constructor only (``runtime.scoped_attrs.module_attrs``: restored when the
constructor returns; the flag is read nowhere else in that module).

Megatron-Core 0.16.1 fix (its bug, any TP > 1 on the local spec): with ``linear_kv_down_proj`` a
``ColumnParallelLinear`` (the local spec), MLA all-gathers its output over TP along the last dim,
``kv_combined = [kv_compressed | k_pos_emb]`` [s, b, kv_lora_rank + qk_rope_head_dim], and uses the
shared RoPE key ``k_pos_emb`` (full sequence on every rank) in this rank's heads only. The gather's
backward keeps this rank's slice of the gradient, so each rank's ``k_pos_emb`` gradient holds its own
heads' share and the shares of the other ranks' heads are dropped: the key RoPE columns of
``linear_kv_down_proj`` (and everything below them: the input layernorm, earlier layers, the
embedding) get a partial gradient (measured: every gradient 0.2-0.7% off, grad norm rel 1e-3 at TP2).
(The ``kv_compressed`` columns are right: ``linear_kv_up_proj``'s backward sums its input gradient
over TP.) Transformer Engine's spec (``TELinear`` "duplicated" down projections, gathered over the
sequence with a reduce-scatter backward) does not have the bug.

``LocalMLASelfAttention`` gathers ``linear_kv_down_proj``'s output itself (a forward hook on its own
submodule, :func:`_gather_kv_down_output`) into the layout of TE's duplicated projection, whose full
last dim (``kv_lora_rank + qk_rope_head_dim``) MLA takes as it is (no gather of its own):
- sequence parallel: Megatron's TP all-gather along the last dim, then this rank's sequence shard
  [s / tp, b, kv_lora_rank + qk_rope_head_dim]. MLA then gathers ``k_pos_emb`` over the sequence
  (``gather_from_sequence_parallel_region``), whose backward reduce-scatters, i.e. sums the RoPE
  key's gradient over TP: the missing sum. ``kv_compressed`` stays this rank's sequence shard, as
  MLA's own gather-then-scatter leaves it.
- no sequence parallel: :class:`_GatherSumRopeKeyGrad` [s, b, kv_lora_rank + qk_rope_head_dim],
  whose backward sums the ``k_pos_emb`` columns' gradient over TP before keeping this rank's slice.
Forward values are Megatron's (the same gathered elements); the q down projection's gather is
Megatron's own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings
from megatron.core.transformer import multi_latent_attention as mla
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from gspo_megatron.runtime.scoped_attrs import module_attrs


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


def _gather_kv_down_output(module, args, output):
    """Forward hook of ``linear_kv_down_proj`` (a ``ColumnParallelLinear``; output, bias): its output
    [s, b, (kv_lora_rank + qk_rope_head_dim) / tp] gathered over ``module.tp_group`` along the last dim,
    as [s / tp, b, kv_lora_rank + qk_rope_head_dim] with sequence parallelism (this rank's sequence
    shard), else [s, b, kv_lora_rank + qk_rope_head_dim] with the RoPE key gradient summed over TP
    (module docstring; THD: t in place of s, b = 1). Already whole (TP 1): left as it is."""
    out, bias = output
    if out.size(-1) == module._gspo_kv_width:
        return None
    group = module.tp_group
    if module.sequence_parallel:
        whole = mappings.gather_from_tensor_model_parallel_region(out, group)
        return mappings.scatter_to_sequence_parallel_region(whole, group), bias
    return _GatherSumRopeKeyGrad.apply(out, group, module._gspo_rope_dim), bias


def _mla_constructor_scope():
    """Around MLA's constructor: without Transformer Engine (``TELinear`` a mock, not a class),
    ``multi_latent_attention.HAVE_TE`` False for the block (module docstring); else nothing."""
    if isinstance(mla.TELinear, type):
        return contextlib.nullcontext()
    return module_attrs(mla, HAVE_TE=False)


class LocalMLASelfAttention(MLASelfAttention):
    """MLASelfAttention of the local spec: built with Megatron's TE flag corrected for it, and with
    ``linear_kv_down_proj``'s output gathered by :func:`_gather_kv_down_output` (module docstring:
    the RoPE key gradient under TP). Same parameters, same forward values."""

    def __init__(self, config, *args, **kwargs):
        with _mla_constructor_scope():
            super().__init__(config, *args, **kwargs)
        down = self.linear_kv_down_proj
        down._gspo_rope_dim = config.qk_pos_emb_head_dim
        down._gspo_kv_width = config.kv_lora_rank + config.qk_pos_emb_head_dim
        down.register_forward_hook(_gather_kv_down_output)


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
    """Every MLA layer of ``block_spec`` (in place): ``LocalMLASelfAttention`` with the local core
    attention. Only the spec changes (no library module attribute)."""
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        if attn.module in (MLASelfAttention, LocalMLASelfAttention):
            attn.module = LocalMLASelfAttention
            if attn.submodules.core_attention is DotProductAttention:
                attn.submodules.core_attention = MLALocalDotProductAttention
