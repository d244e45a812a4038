"""Loading a Megatron dist checkpoint without re-assembling the gated MLP's fc1 (one copy less).

Megatron-Core saves a gated (SwiGLU) ``linear_fc1.weight`` of shape ``[2*ffn, hidden]`` through a
``ShardedTensorFactory`` (``apply_swiglu_sharded_factory``): two ShardedTensors, ``torch.chunk``
views of the parameter along dim 0 (gate rows, then up rows). On load, dist_checkpointing reads
each half *into those views* (the torch_dist strategy loads into the tensors it is given), then the
factory's ``merge_fn`` concatenates them into a new tensor (``torch.cat``), which
``model.load_state_dict`` copies back into the very parameter the halves were read into. For an MoE
that is most of the bytes read twice more (measured: 0.8 s of a 5.3 s Megatron -> HF conversion of a
0.9 GB Qwen3-MoE was that ``torch.cat``).

:func:`merge_swiglu_in_place` replaces that merge, for Megatron's own swiglu factories only, by one
that returns the parameter itself when the loaded halves are exactly its two consecutive halves in
memory (then ``cat(halves) == parameter`` bitwise, by construction), and falls back to Megatron's
merge otherwise (a strategy that loaded elsewhere, a flattened range, another merge function).
"""

from __future__ import annotations

import torch

_SWIGLU_MERGE = ("megatron.core.transformer.mlp", "sh_ten_merge_fn")


def _halves_are_data(parts, data: torch.Tensor | None) -> bool:
    """``parts`` (the loaded sub-state-dict) are, in order, consecutive dim-0 slices of ``data``'s
    memory covering all of it: concatenating them along dim 0 gives ``data``."""
    if data is None or not isinstance(parts, (list, tuple)) or not parts or not data.is_contiguous():
        return False
    if not all(isinstance(p, torch.Tensor) for p in parts):
        return False
    ptr, size = data.data_ptr(), data.element_size()
    for p in parts:
        if (p.dtype != data.dtype or p.device != data.device or not p.is_contiguous() or p.dim() != data.dim()
                or p.shape[1:] != data.shape[1:] or p.data_ptr() != ptr):
            return False
        ptr += p.numel() * size
    return ptr == data.data_ptr() + data.numel() * size


def _in_place(factory):
    merge, data = factory.merge_fn, factory.data

    def merge_fn(parts):
        if _halves_are_data(parts, data):
            return data
        return merge(parts)

    return merge_fn


def merge_swiglu_in_place(sharded_state_dict) -> int:
    """Walk a (nested) sharded state dict before ``dist_checkpointing.load`` and give Megatron's
    swiglu factories the in-place merge (see the module docstring). Returns how many were changed."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    changed = 0
    for v in nested_values(sharded_state_dict):
        fn = getattr(v, "merge_fn", None)
        if isinstance(v, ShardedTensorFactory) and v.flattened_range is None \
                and (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) == _SWIGLU_MERGE:
            v.merge_fn = _in_place(v)
            changed += 1
    return changed
