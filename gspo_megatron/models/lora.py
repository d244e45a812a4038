"""LoRA on Megatron-Core's own linear layers (``model.lora``), the base frozen.

A target linear ``y = W x`` (``W``: [out, in]) becomes ``y = W x + s B A dropout(x)`` with
``A``: [r, in], ``B``: [r -> out] = [out, r], ``s = alpha / r``. ``A`` starts uniform in
+-1/sqrt(in) (PEFT's kaiming-uniform bound, drawn from a generator seeded by ``seed`` and the
layer's *global* parameter name, so every layout starts from the same adapters) and ``B`` at zero,
so a fresh adapter leaves the model's output bitwise unchanged. Every other parameter (embeddings,
norms, the router, the output layer, the base weights) gets ``requires_grad=False``: Megatron's DDP
builds grad buffers only for the adapters and the (distributed) optimizer holds only their state.

Applied by :func:`apply_lora` inside ``models.build.build_model``, right after ``GPTModel`` is built
and before DDP: each targeted ``ColumnParallelLinear`` / ``RowParallelLinear`` (the local spec's
attention ``linear_qkv`` / ``linear_proj``, MLA's ``linear_q_proj`` / ``linear_q_down_proj`` /
``linear_q_up_proj`` / ``linear_kv_down_proj`` / ``linear_kv_up_proj``, the dense MLP's, the shared
experts' and every routed expert's ``linear_fc1`` / ``linear_fc2`` in ``SequentialMLP``) becomes the
LoRA subclass of its own class (:class:`LoraColumnParallelLinear`, :class:`LoraRowParallelLinear`),
keeping its parameter names (``<module>.weight``) and adding ``<module>.lora_A`` /
``<module>.lora_B``. Routed experts have one A/B per expert, owned and EP-sharded with it (global
expert index in the name, ``param_names.global_names``), marked expert-parallel like the expert
(``allreduce``). Transformer Engine layers (``TEGroupedMLP``, fused layer-norm linears) are refused.

Tensor parallelism (TP ranks t = 0..T-1, the expert-TP group for routed experts):

- column-parallel base, ``W_t``: [out/T, in] (rows split): ``A``: [r, in] replicated, ``B_t``:
  [out/T, r] split like W's rows (gated fc1: ``[gate_t; up_t]`` like W). ``h = A x``; dense
  sequence-parallel: ``h`` all-gathered over the sequence like the base's input (backward:
  reduce-scatter), dA summed over TP (each rank saw its own tokens); dense without SP: ``h`` through
  copy-to-TP (backward all-reduce of dh, a partial sum over B's row shards); routed experts (explicit
  expert communication: the dispatcher gathers tokens and sums dx): dh stays partial and dA is
  summed over the expert-TP group. ``delta_t = s B_t h``: [tokens, out/T].
- row-parallel base, ``W_t``: [out, in/T] (columns split): ``A_t``: [r, in/T] split like W's columns,
  ``B``: [out, r] replicated. ``h_t = A_t x_t`` is a partial sum, reduced like the base output (dense
  SP: reduce-scatter to the sequence shard, dB summed over TP; dense without SP: all-reduce; routed
  experts: left partial, ``s B h_t`` added to the partial base output, so the dispatcher's sum of
  the base output covers it, and dB summed over the expert-TP group).

Merging: ``W_t + s B_t A_t`` is this rank's shard of the merged weight in both cases (column:
``A_t = A``; row: ``B_t = B``), so :func:`merged_weight` merges per rank and the export stream
(``weights.gather_full``) gathers merged shards like the base's: HF export, weight sync and the
KL reference see the merged model.
"""

from __future__ import annotations

import math
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

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


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


class _LoraMixin:
    """The adapter state shared by both subclasses (set by :meth:`_init_lora`)."""

    # provided by the Megatron linear the mixin is combined with (ColumnParallelLinear /
    # RowParallelLinear, a torch.nn.Module)
    weight: torch.nn.Parameter
    tp_group: dist.ProcessGroup | None
    training: bool
    state_dict: Callable[..., dict[str, Any]]

    def _init_lora(
        self, opts: LoraOptions, global_name: str, gated: bool, a_full_in: int, a_cols: slice | None, b_rows: int
    ) -> None:
        dtype, device = self.weight.dtype, self.weight.device
        r = int(opts.rank)
        g = torch.Generator().manual_seed((int(opts.seed) * 1_000_003 + zlib.crc32(global_name.encode())) % 2**63)
        bound = 1.0 / math.sqrt(a_full_in)
        a = (torch.rand(r, a_full_in, generator=g, dtype=torch.float64) * 2 - 1) * bound
        if a_cols is not None:
            a = a[:, a_cols]
        self.lora_A = torch.nn.Parameter(a.to(dtype=dtype, device=device).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(b_rows, r, dtype=dtype, device=device))
        for p in (self.lora_A, self.lora_B):
            setattr(p, "lora_adapter", True)  # weights._mapped skips these; export merges them (merged_weight)
            setattr(p, "allreduce", getattr(self.weight, "allreduce", True))  # expert-parallel like the expert
        self.lora_scaling = opts.scaling
        self.lora_dropout = float(opts.dropout)
        self.lora_gated = gated
        self.lora_global_name = global_name
        me = weakref.ref(self)
        setattr(self.weight, "lora_merged", lambda: merged_weight(me()))

    def _lora_input(self, x):
        return F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout > 0 else x

    def _lora_tp(self) -> int:
        return _group_size(self.tp_group)

    def _lora_sharded(self, prefix, sharded_offsets, metadata, axis_map: dict):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(
            state_dict, prefix, axis_map, sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]
        )
        if self.lora_gated and f"{prefix}lora_B" in out:  # [gate_t; up_t] rows, like the fc1 weight
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            singleton = (metadata or {}).get("singleton_local_shards", False)
            out[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(out[f"{prefix}lora_B"], sharded_offsets, singleton)
        return out


def _column_class():
    from megatron.core.tensor_parallel import layers, mappings

    class LoraColumnParallelLinear(_LoraMixin, layers.ColumnParallelLinear):
        """ColumnParallelLinear + ``s B_t (A x)`` (module docstring: A replicated, B row-split)."""

        def forward(self, input_, weight=None, runtime_gather_output=None):
            out, bias = super().forward(input_, weight, runtime_gather_output)
            tp = self._lora_tp()
            A = self.lora_A
            if tp > 1 and (self.explicit_expert_comm or self.sequence_parallel):
                A = _SumGrad.apply(A, self.tp_group)  # each rank's dA covers its tokens / its dh share
            h = F.linear(self._lora_input(input_), A)
            if tp > 1 and not self.explicit_expert_comm:
                if self.sequence_parallel:
                    h = mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
                elif not self.disable_grad_reduce:
                    h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            delta = F.linear(h, self.lora_B) * self.lora_scaling
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            if gather and tp > 1:
                delta = mappings.gather_from_tensor_model_parallel_region(delta, group=self.tp_group)
            return out + delta, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._lora_sharded(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0, "lora_B": 0})

    return LoraColumnParallelLinear


def _row_class():
    from megatron.core.tensor_parallel import layers, mappings

    class LoraRowParallelLinear(_LoraMixin, layers.RowParallelLinear):
        """RowParallelLinear + ``s B (sum_t A_t x_t)`` (module docstring: A column-split, B replicated)."""

        def forward(self, input_):
            out, bias = super().forward(input_)
            tp = self._lora_tp()
            x = self._lora_input(input_)
            if not self.input_is_parallel and tp > 1:
                x = mappings.scatter_to_tensor_model_parallel_region(x, group=self.tp_group)
            h = F.linear(x, self.lora_A)
            B = self.lora_B
            if tp > 1 and not self.explicit_expert_comm:
                if self.sequence_parallel:
                    h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
                else:
                    h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            if tp > 1 and (self.explicit_expert_comm or self.sequence_parallel):
                B = _SumGrad.apply(B, self.tp_group)  # dB from this rank's tokens / its partial h
            return out + F.linear(h, B) * self.lora_scaling, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return self._lora_sharded(prefix, sharded_offsets, metadata, {"weight": 1, "lora_A": 1})

    return LoraRowParallelLinear


_CLASSES: dict = {}


def lora_classes() -> tuple[type, type]:
    """(LoraColumnParallelLinear, LoraRowParallelLinear), built once (Megatron imported lazily)."""
    if not _CLASSES:
        _CLASSES["column"], _CLASSES["row"] = _column_class(), _row_class()
    return _CLASSES["column"], _CLASSES["row"]


def _path_key(name: str) -> str:
    """A module path without its expert slot (``...experts.local_experts.3.linear_fc1`` ->
    ``...experts.linear_fc1``), for target matching."""
    import re

    return re.sub(r"\.local_experts\.\d+\.", ".", name)


def matches(name: str, targets) -> bool:
    key = "." + _path_key(name)
    return any(key.endswith("." + t) for t in targets)


def apply_lora(model, opts: LoraOptions) -> int:
    """Turn every targeted linear of ``model`` (one GPTModel chunk) into its LoRA subclass, then freeze
    every other parameter. Returns how many linears got adapters. Raises ValueError naming
    ``model.lora.target_modules`` when an entry matches nothing here or a targeted module is not a
    local-spec linear (Transformer Engine layers, grouped-GEMM experts)."""
    from megatron.core.tensor_parallel import layers

    from gspo_megatron.models.param_names import global_names

    column, row = lora_classes()
    gnames = global_names(model)
    wrapped = 0
    used: set[str] = set()
    for name, module in list(model.named_modules()):
        if not name or not matches(name, opts.target_modules):
            continue
        used.update(t for t in opts.target_modules if ("." + _path_key(name)).endswith("." + t))
        if type(module) is layers.ColumnParallelLinear:
            module.__class__ = column
            gated = name.endswith("linear_fc1") and bool(module.config.gated_linear_unit)
            module._init_lora(
                opts, gnames[name + ".weight"], gated, module.input_size, None, module.output_size_per_partition
            )
        elif type(module) is layers.RowParallelLinear:
            module.__class__ = row
            rank = dist.get_rank(module.tp_group) if _group_size(module.tp_group) > 1 else 0
            n = module.input_size_per_partition
            module._init_lora(
                opts,
                gnames[name + ".weight"],
                False,
                module.input_size,
                slice(rank * n, (rank + 1) * n),
                module.output_size,
            )
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            set_tensor_model_parallel_attributes(module.lora_A, True, 1, 1)
            wrapped += 1
            continue
        elif isinstance(module, (column, row)):
            continue
        else:
            raise ValueError(
                f"model.lora.target_modules: {name} is a {type(module).__name__}, not a local-spec "
                "ColumnParallelLinear / RowParallelLinear (set model.transformer_impl=local)"
            )
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(module.lora_B, True, 0, 1)
        wrapped += 1
    for name, p in model.named_parameters():
        if not getattr(p, "lora_adapter", False):
            p.requires_grad_(False)
    model.lora = opts.to_dict()
    model.lora_unused_targets = sorted(set(opts.target_modules) - used)
    return wrapped


def check_targets_used(unused_per_chunk: list[list[str]]) -> None:
    """Raise ValueError naming ``model.lora.target_modules`` for entries no rank's model matched
    (callers pass every rank's ``model.lora_unused_targets``). A bare layer name (``DEFAULT_TARGETS``,
    e.g. ``linear_q_down_proj`` on a model without MLA) applies where the architecture has it; a
    dotted suffix must match."""
    unused = set.intersection(*(set(u) for u in unused_per_chunk)) if unused_per_chunk else set()
    unused -= set(DEFAULT_TARGETS)
    if unused:
        raise ValueError(f"model.lora.target_modules: {sorted(unused)} match no linear layer of this model")


def lora_modules(model):
    """(name, module) of every LoRA linear of ``model``."""
    column, row = lora_classes()
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (column, row))]


def adapter_nbytes(model) -> int:
    """Bytes of every adapter of the whole model, each once and unsharded, in its dtype: what an
    adapter-only sync would send per step (``sync/lora_adapter_bytes``; compare ``sync/bytes_total``,
    the merged model). Per LoRA linear ``r * (in + out) * element_size`` (full ``in`` / ``out``: A
    [r, in], B [out, r]). Collective when distributed (one all_gather_object of {global name: bytes},
    so TP / DP replicas count once and PP / EP owners all count); 0 without LoRA."""
    mine = {
        m.lora_global_name: int(m.lora_A.shape[0]) * (int(m.input_size) + int(m.output_size)) * m.lora_A.element_size()
        for _, m in lora_modules(model)
    }
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]  # each rank's, filled in
        dist.all_gather_object(everyone, mine)
        for d in everyone:
            mine.update(d)
    return sum(mine.values())


@torch.no_grad()
def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + s B A`` in fp32, cast to W's dtype: the one merge every merged weight goes through (the
    merged export and sync here, the CPU server serving an adapter: cpu_server/lora.py)."""
    return (w.detach().float() + scaling * (b.detach().float() @ a.detach().float())).to(w.dtype)


def merged_weight(module) -> torch.Tensor:
    """This rank's shard of the merged weight, ``W_t + s B_t A_t`` (fp32 product, W's dtype)."""
    return merge(module.weight, module.lora_A, module.lora_B, module.lora_scaling)


@torch.no_grad()
def merge_into_base(model) -> None:
    """Fold every adapter into its base weight and zero B (for tests and one-off merges)."""
    for _, m in lora_modules(model):
        m.weight.data.copy_(merged_weight(m))
        m.lora_B.zero_()
