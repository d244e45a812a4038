"""Two fixes to Megatron-Core 0.16.1's local (non-TE) layer spec for gpt-oss; computation unchanged.

1. Attention sinks: ``DotProductAttention`` with ``softmax_type="learnable"`` holds the sinks as
   ``softmax_offset`` [num_heads / TP] (this rank's heads) but, unlike the linear layers' weights, does
   not mark it tensor-parallel. Megatron's gradient norm (``clip_grads``) then treats it as replicated
   over TP and counts it on TP rank 0 only (the norm in TP2 would miss half of the sinks' gradients).
   ``SinkDotProductAttention`` marks it split along dim 0 (``tensor_model_parallel``); it has no
   ``sequence_parallel`` attribute, so no TP all-reduce touches it either.
2. Expert biases: with a bias, ``MLP.forward`` of an expert adds the prob-scaled fc2 bias *in place*
   to the output of ``RowParallelLinear``, which is the output of a custom autograd Function returned
   as-is (``_ReduceFromModelParallelRegion``): autograd refuses the in-place update when gradients
   are on (training). ``ExpertRowParallelLinear`` returns a copy of that output. It also clears the
   ``sequence_parallel`` mark Megatron puts on that bias even for an expert (which would make
   ``finalize_model_grads`` sum its gradient over TP a second time: a wrong update in TP2).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear, set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SinkDotProductAttention(DotProductAttention):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)


class ExpertRowParallelLinear(RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            # Megatron marks this bias sequence-parallel even for an expert, so finalize_model_grads
            # would sum its gradient over TP on top of the expert-data-parallel reduction that already
            # covers the TP ranks (ETP 1): doubled in TP2. An expert bias is reduced like its weight.
            self.bias.sequence_parallel = False

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return (output.clone() if bias is not None and torch.is_grad_enabled() else output), bias


def adapt_local_spec(block_spec) -> None:
    """Swap in both classes in every layer of ``block_spec`` (in place)."""
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        if attn.submodules.core_attention is DotProductAttention:
            attn.submodules.core_attention = SinkDotProductAttention
        experts = getattr(getattr(layer.submodules.mlp, "submodules", None), "experts", None)
        fc = getattr(getattr(experts, "submodules", None), "linear_fc2", None)
        if experts is not None and fc is RowParallelLinear:
            experts.submodules.linear_fc2 = ExpertRowParallelLinear
