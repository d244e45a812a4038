"""LoRA on Megatron-Core's own linear layers (``model.lora``), the base frozen.

A target linear ``y = W x`` (``W``: [out, in]) becomes ``y = W x + s B A dropout(x)`` with
``A``: [r, in], ``B``: [out, r], ``s = alpha / r`` (the adapter pair, its seeding and the merge:
``models/lora_base.py``; a fresh adapter leaves the model's output bitwise unchanged). Every other
parameter (embeddings, norms, the router, the output layer, the base weights) gets
``requires_grad=False``: Megatron's DDP builds grad buffers only for the adapters and the
(distributed) optimizer holds only their state.

Applied by :func:`apply_lora` inside ``models.build.build_model``, right after ``GPTModel`` is built
and before DDP: each targeted ``ColumnParallelLinear`` / ``RowParallelLinear`` (the local spec's
attention ``linear_qkv`` / ``linear_proj``, MLA's ``linear_q_proj`` / ``linear_q_down_proj`` /
``linear_q_up_proj`` / ``linear_kv_down_proj`` / ``linear_kv_up_proj``, the dense MLP's, the shared
experts' and every routed expert's ``linear_fc1`` / ``linear_fc2`` in ``SequentialMLP``) becomes the
LoRA subclass of its own class (:class:`LoraColumnParallelLinear`, :class:`LoraRowParallelLinear`),
keeping its parameter names (``<module>.weight``) and adding ``<module>.lora_A`` /
``<module>.lora_B``. Routed experts have one A/B per expert, owned and EP-sharded with it (global
expert index in the name, ``param_names.global_names``), marked expert-parallel like the expert
(``allreduce``). Transformer Engine's linears and grouped expert GEMMs get their LoRA subclasses from
``models/lora_te.py`` (same adapters, same rules below).

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

import torch
import torch.distributed as dist

from gspo_megatron.models.lora_base import (
    ATTENTION_TARGETS,
    DEFAULT_TARGETS,
    MLP_TARGETS,
    LoraMixin,
    LoraOptions,
    column_delta,
    merge,
    merged_weight,
    row_delta,
    sharded_with_adapters,
)

__all__ = ["ATTENTION_TARGETS", "DEFAULT_TARGETS", "MLP_TARGETS", "LoraOptions", "merge", "merged_weight"]


def _column_class():
    from megatron.core.tensor_parallel import layers, mappings

    class LoraColumnParallelLinear(LoraMixin, layers.ColumnParallelLinear):
        """ColumnParallelLinear + ``s B_t (A x)`` (module docstring: A replicated, B row-split)."""

        def forward(self, input_, weight=None, runtime_gather_output=None):
            out, bias = super().forward(input_, weight, runtime_gather_output)
            delta = column_delta(
                self,
                self._lora_input(input_),
                expert=self.explicit_expert_comm,
                sequence_parallel=self.sequence_parallel,
                grad_reduce=not self.disable_grad_reduce,
            )
            gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
            if gather and self._lora_tp() > 1:
                delta = mappings.gather_from_tensor_model_parallel_region(delta, group=self.tp_group)
            return out + delta, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded_with_adapters(
                self, prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0, "lora_B": 0}, self.tp_group
            )

    return LoraColumnParallelLinear


def _row_class():
    from megatron.core.tensor_parallel import layers, mappings

    class LoraRowParallelLinear(LoraMixin, layers.RowParallelLinear):
        """RowParallelLinear + ``s B (sum_t A_t x_t)`` (module docstring: A column-split, B replicated)."""

        def forward(self, input_):
            out, bias = super().forward(input_)
            x = self._lora_input(input_)
            if not self.input_is_parallel and self._lora_tp() > 1:
                x = mappings.scatter_to_tensor_model_parallel_region(x, group=self.tp_group)
            delta = row_delta(self, x, expert=self.explicit_expert_comm, sequence_parallel=self.sequence_parallel)
            return out + delta, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded_with_adapters(
                self, prefix, sharded_offsets, metadata, {"weight": 1, "lora_A": 1}, self.tp_group
            )

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


def _wrap_local(module, name: str, gnames: dict, opts: LoraOptions) -> int | None:
    """A local-spec ColumnParallelLinear / RowParallelLinear -> its LoRA subclass (1), else None: its
    adapter split over the layer's TP group as the module docstring says (``lora_base.new_adapter``)."""
    from megatron.core.tensor_parallel import layers

    if type(module) not in (layers.ColumnParallelLinear, layers.RowParallelLinear):
        return None
    column = type(module) is layers.ColumnParallelLinear
    gated = column and name.endswith("linear_fc1") and bool(module.config.gated_linear_unit)
    module.__class__ = lora_classes()[0 if column else 1]
    module._init_lora(opts, gnames[name + ".weight"], column=column, tp_group=module.tp_group, gated=gated)
    return 1


def apply_lora(model, opts: LoraOptions) -> int:
    """Turn every targeted linear of ``model`` (one GPTModel chunk) into its LoRA subclass (the local
    spec's here, Transformer Engine's in ``lora_te``), then freeze every other parameter. Returns how
    many adapters it made (one per routed expert of a grouped linear). Raises ValueError naming
    ``model.lora.target_modules`` when a targeted module is no linear either spec wraps."""
    from gspo_megatron.models.lora_te import wrap_te
    from gspo_megatron.models.param_names import global_names

    gnames = global_names(model)
    wrapped = 0
    used: set[str] = set()
    for name, module in list(model.named_modules()):
        if not name or not matches(name, opts.target_modules):
            continue
        used.update(t for t in opts.target_modules if ("." + _path_key(name)).endswith("." + t))
        if getattr(module, "lora_scaling", None) is not None:
            continue  # already wrapped
        n = _wrap_local(module, name, gnames, opts)
        if n is None:
            n = wrap_te(module, name, gnames, opts)
        if n is None:
            raise ValueError(
                f"model.lora.target_modules: {name} is a {type(module).__name__}, not a linear layer LoRA "
                "wraps (Megatron's local ColumnParallelLinear / RowParallelLinear, or Transformer Engine's "
                "linears and grouped expert linears)"
            )
        wrapped += n
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
    """(name, adapter) of every adapter of ``model``: each LoRA linear, and each routed expert of a
    LoRA grouped linear (``lora_te.ExpertAdapter``, named ``<module>.<local expert>``); every one has
    the attributes ``lora_base`` lists."""
    out = []
    for n, m in model.named_modules():
        experts = getattr(m, "lora_experts", None)
        if experts is not None:
            out.extend((f"{n}.{ad.i}", ad) for ad in experts)
        elif isinstance(m, LoraMixin) and hasattr(m, "lora_A"):
            out.append((n, m))
    return out


def adapter_nbytes(model) -> int:
    """Bytes of every adapter of the whole model, each once and unsharded, in its dtype: what an
    adapter-only sync would send per step (``sync/lora_adapter_bytes``; compare ``sync/bytes_total``,
    the merged model). Per adapter ``r * (in + out) * element_size`` (full ``in`` / ``out``: A
    [r, in], B [out, r]). Collective when distributed (one all_gather_object of {global name: bytes},
    so TP / DP replicas count once and PP / EP owners all count); 0 without LoRA."""
    mine = {
        m.lora_global_name: int(m.lora_A.shape[0]) * (m.lora_full_in + m.lora_full_out) * m.lora_A.element_size()
        for _, m in lora_modules(model)
    }
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]  # each rank's, filled in
        dist.all_gather_object(everyone, mine)
        for d in everyone:
            mine.update(d)
    return sum(mine.values())


@torch.no_grad()
def merge_into_base(model) -> None:
    """Fold every adapter into its base weight and zero B (for tests and one-off merges)."""
    for _, m in lora_modules(model):
        m.weight.data.copy_(merged_weight(m))
        m.lora_B.zero_()
