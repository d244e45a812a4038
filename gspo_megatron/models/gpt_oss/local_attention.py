"""Attention sinks on Megatron-Core 0.16.1's local spec.

``DotProductAttention`` with ``softmax_type="learnable"`` holds the sinks as ``softmax_offset``
[num_heads / TP] (this rank's heads) but, unlike the linear layers' weights, does not mark it
tensor-parallel. Megatron's gradient-norm (``clip_grads``) then treats it as replicated over TP and
counts it on TP rank 0 only, so the norm in TP2 would miss half of the sinks' gradients.
``SinkDotProductAttention`` marks it split along dim 0 (``tensor_model_parallel``), which also keeps
it out of any TP all-reduce (it has no ``sequence_parallel`` attribute). Computation unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SinkDotProductAttention(DotProductAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        if isinstance(self.softmax_offset, torch.nn.Parameter):
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)


def use_sink_attention(block_spec) -> None:
    """Swap the local core attention of every layer in ``block_spec`` (in place)."""
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        if attn.submodules.core_attention is DotProductAttention:
            attn.submodules.core_attention = SinkDotProductAttention
