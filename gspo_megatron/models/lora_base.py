"""What every LoRA adapter shares, whichever layer spec it sits on (``models/lora.py``: Megatron-Core's
local linears; ``models/lora_te.py``: Transformer Engine's): the options, the adapter pair and its
seeding, the gradient sum over a TP group, and the merge ``W + s B A``.

An *adapter* is one (A, B) pair on one base weight ``W`` ([out, in] on one rank):
``y = W x + s B A dropout(x)``, ``A``: [r, in], ``B``: [out, r], ``s = alpha / r``. ``A`` starts uniform
in +-1/sqrt(in) (PEFT's kaiming-uniform bound) from a generator seeded by ``seed`` and the weight's
*spec-independent* global name (:func:`seed_name`: a Transformer Engine grouped expert
``experts.linear_fc1.weight7`` seeds as the local spec's ``experts.local_experts.7.linear_fc1.weight``),
so every layout and both specs start from the same adapters; ``B`` starts at zero, so a fresh adapter
leaves the model's output bitwise unchanged.

Every adapter object (a LoRA linear module, or one expert of a grouped one: ``lora_te.ExpertAdapter``)
exposes the same attributes, which the export, the adapter sync and the PEFT writer read:
``weight``, ``lora_A``, ``lora_B``, ``lora_scaling``, ``lora_global_name`` (the base weight's global
name), ``lora_column`` (column-parallel base: B split like W's rows; else row-parallel or whole: A
split like W's columns), ``lora_tp_group`` (the group A / B are split over; None when whole),
``lora_gated`` (B rows ``[gate_t; up_t]`` like a gated fc1), ``lora_full_in`` / ``lora_full_out``
(the unsharded in / out sizes).
"""

from __future__ import annotations

import math
import re
import weakref
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

ATTENTION_TARGETS = (
    "linear_qkv",
    "linear_proj",
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)
MLP_TARGETS = ("linear_fc1", "linear_fc2")
DEFAULT_TARGETS = ATTENTION_TARGETS + MLP_TARGETS

_GROUPED = re.compile(r"\.experts\.linear_fc([12])\.weight(\d+)$")


@dataclass
class LoraOptions:
    """rank r, alpha (s = alpha / r), dropout on the adapter input, the targeted modules (names or
    dotted suffixes of the module path with ``local_experts.<i>.`` removed, e.g. ``linear_fc1``,
    ``experts.linear_fc1`` (routed only), ``shared_experts.linear_fc2``, ``self_attention.linear_qkv``),
    and the init seed."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    seed: int = 0

    @property
    def scaling(self) -> float:
        return float(self.alpha) / int(self.rank)

    def to_dict(self) -> dict:
        return dict(
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            target_modules=list(self.target_modules),
            seed=self.seed,
        )


def seed_name(global_name: str) -> str:
    """The base weight's global name as the local spec spells it (module docstring)."""
    return _GROUPED.sub(lambda m: f".experts.local_experts.{m.group(2)}.linear_fc{m.group(1)}.weight", global_name)


class _SumGrad(torch.autograd.Function):
    """Identity on a weight in forward; its gradient summed over ``group`` in backward."""

    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad(weight: torch.Tensor, group) -> torch.Tensor:
    """``weight`` whose gradient is summed over ``group`` (each rank saw its own tokens / its share)."""
    return _SumGrad.apply(weight, group)


def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


class Adapter(NamedTuple):
    """A fresh adapter pair and its base weight's unsharded sizes (:func:`new_adapter`)."""

    A: torch.nn.Parameter
    B: torch.nn.Parameter
    full_in: int
    full_out: int


def new_adapter(weight: torch.Tensor, opts: LoraOptions, global_name: str, *, column: bool, group) -> Adapter:
    """The adapter of ``weight``, this rank's shard [out, in] of the base weight, split over ``group``
    (T ranks, this one t; None: whole on every rank, T = 1), every size derived from the shard:

    - column-parallel (``column``: W's rows split): full [out * T, in]; A [r, in] whole, replicated;
      B [out, r], this rank's rows (zeros), marked tensor-parallel along dim 0;
    - row-parallel (W's columns split): full [out, in * T]; A [r, in], this rank's columns t*in..(t+1)*in
      of the full [r, in * T] (drawn whole: every layout starts from the same A), marked
      tensor-parallel along dim 1; B [out, r] whole, replicated (zeros);
    - ``group`` None (whole, e.g. a duplicated ``TELinear``): both whole and unmarked (the grad norm
      counts an unmarked parameter on TP rank 0 only).

    A is drawn in fp64 (module docstring: seeded by ``seed`` and the spec-independent name, uniform in
    +-1/sqrt(full in)); A and B take W's dtype and device, are marked ``lora_adapter`` (the export skips
    them and merges them into W) and expert-parallel like W (``allreduce``)."""
    n_out, n_in = weight.shape
    size = group_size(group)
    t = dist.get_rank(group) if size > 1 else 0
    full_in, full_out = (n_in, n_out * size) if column else (n_in * size, n_out)
    r = int(opts.rank)
    g = torch.Generator().manual_seed(
        (int(opts.seed) * 1_000_003 + zlib.crc32(seed_name(global_name).encode())) % 2**63
    )
    bound = 1.0 / math.sqrt(full_in)
    a = (torch.rand(r, full_in, generator=g, dtype=torch.float64) * 2 - 1) * bound
    if not column:
        a = a[:, t * n_in : (t + 1) * n_in]
    A = torch.nn.Parameter(a.to(dtype=weight.dtype, device=weight.device).contiguous())
    B = torch.nn.Parameter(torch.zeros(n_out, r, dtype=weight.dtype, device=weight.device))
    for p in (A, B):
        setattr(p, "lora_adapter", True)  # weights._mapped skips these; export merges them (merged_weight)
        setattr(p, "allreduce", getattr(weight, "allreduce", True))  # expert-parallel like the expert
    if group is not None:  # the split factor: the grad norm counts it on every rank, the replicated one once
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(B if column else A, True, 0 if column else 1, 1)
    return Adapter(A, B, int(full_in), int(full_out))


def attach_merge(adapter) -> None:
    """``adapter.weight.lora_merged()``: this rank's merged shard, what the export stream reads."""
    me = weakref.ref(adapter)
    setattr(adapter.weight, "lora_merged", lambda: merged_weight(me()))


class LoraMixin:
    """The adapter state of a LoRA linear module (set by :meth:`_init_lora`; module docstring)."""

    # provided by the linear the mixin is combined with (a torch.nn.Module)
    weight: torch.nn.Parameter
    training: bool

    def _init_lora(self, opts: LoraOptions, global_name: str, *, column: bool, tp_group, gated: bool) -> None:
        """Fresh adapters for ``self.weight`` split over ``tp_group`` (None: whole; :func:`new_adapter`)."""
        self.lora_A, self.lora_B, full_in, full_out = new_adapter(
            self.weight, opts, global_name, column=column, group=tp_group
        )
        self.lora_scaling = opts.scaling
        self.lora_dropout = float(opts.dropout)
        self.lora_gated = gated
        self.lora_global_name = global_name
        self.lora_column = column
        self.lora_tp_group = tp_group
        self.lora_full_in, self.lora_full_out = full_in, full_out
        attach_merge(self)

    def _lora_input(self, x):
        return F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout > 0 else x

    def _lora_tp(self) -> int:
        return group_size(self.lora_tp_group)


@torch.no_grad()
def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + s B A`` in fp32, cast to W's dtype: the one merge every merged weight goes through (the
    merged export and sync here, the CPU server serving an adapter: cpu_server/lora.py)."""
    return (w.detach().float() + scaling * (b.detach().float() @ a.detach().float())).to(w.dtype)


def merged_weight(adapter) -> torch.Tensor:
    """This rank's shard of the merged weight, ``W_t + s B_t A_t`` (fp32 product, W's dtype)."""
    return merge(adapter.weight, adapter.lora_A, adapter.lora_B, adapter.lora_scaling)


def column_delta(ad, x: torch.Tensor, *, expert: bool, sequence_parallel: bool, grad_reduce: bool = True):
    """``s B_t (A x)``: [tokens, out/T] for a column-parallel base (``models/lora.py`` docstring: A
    replicated, B split like W's rows). ``x``: the base's input on this rank (through the adapter's
    dropout); ``expert``: explicit expert communication (dh left partial, dA summed over the group);
    dense: ``h`` gathered over the sequence (SP) or through copy-to-TP (``grad_reduce``)."""
    from megatron.core.tensor_parallel import mappings

    group = ad.lora_tp_group
    tp = group_size(group)
    A = ad.lora_A
    if tp > 1 and (expert or sequence_parallel):
        A = sum_grad(A, group)  # each rank's dA covers its tokens / its dh share
    h = F.linear(x, A)
    if tp > 1 and not expert:
        if sequence_parallel:
            h = mappings.gather_from_sequence_parallel_region(h, group=group)
        elif grad_reduce:
            h = mappings.copy_to_tensor_model_parallel_region(h, group=group)
    return F.linear(h, ad.lora_B) * ad.lora_scaling


def row_delta(ad, x: torch.Tensor, *, expert: bool, sequence_parallel: bool):
    """``s B (sum_t A_t x_t)`` for a row-parallel base (A split like W's columns, B replicated);
    ``x``: this rank's input columns (through the adapter's dropout). Dense: ``h_t`` reduced like the
    base output (SP: reduce-scatter to the sequence shard); experts: left partial (the dispatcher
    sums the output); dB summed over the group where each rank saw its own share."""
    from megatron.core.tensor_parallel import mappings

    group = ad.lora_tp_group
    tp = group_size(group)
    h = F.linear(x, ad.lora_A)
    B = ad.lora_B
    if tp > 1 and not expert:
        if sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=group)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=group)
    if tp > 1 and (expert or sequence_parallel):
        B = sum_grad(B, group)  # dB from this rank's tokens / its partial h
    return F.linear(h, B) * ad.lora_scaling


def sharded_with_adapters(module, prefix, sharded_offsets, metadata, axis_map: dict, tp_group):
    """A LoRA linear's sharded state dict, adapters included (``axis_map``: the split factor's TP
    axis beside the base's); B of a gated fc1 split by halves like the weight (megatron's MLP applies
    ``apply_swiglu_sharded_factory`` to ``linear_fc1.weight`` only)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    state_dict = module.state_dict(prefix="", keep_vars=True)
    out = make_sharded_tensors_for_checkpoint(
        state_dict, prefix, axis_map, sharded_offsets, tp_group=tp_group, dp_cp_group=metadata["dp_cp_group"]
    )
    if module.lora_gated and f"{prefix}lora_B" in out:  # [gate_t; up_t] rows, like the fc1 weight
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

        singleton = (metadata or {}).get("singleton_local_shards", False)
        out[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(out[f"{prefix}lora_B"], sharded_offsets, singleton)
    return out
