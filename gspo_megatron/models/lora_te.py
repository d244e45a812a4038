"""LoRA on Transformer Engine's layer spec: LoRA subclasses of megatron-core 0.16.1's TE wrappers
(``megatron/core/extensions/transformer_engine.py``), the same adapters and the same tensor-parallel
rules as the local spec's (``models/lora.py`` docstring; shared code in ``models/lora_base.py``):

- ``TELayerNormColumnParallelLinear`` (attention ``linear_qkv``, MLA's ``linear_q_up_proj`` /
  ``linear_kv_up_proj``, a dense MLP's ``linear_fc1``: the norm fused in): the adapter reads the
  *normalized* input, which TE returns alongside the output when ``return_layernorm_output`` is set
  (``module/layernorm_linear.py``: the layer's own norm, no second one). Not the gathered form
  (``return_layernorm_output_gathered``): TE's backward drops the gradient of a gathered norm output
  (it adds ``grad_outputs[1]`` only when not gathered), so the adapter gathers its rank-r ``h = A x``
  over the sequence itself, as the local column adapter does (fewer bytes than the hidden states too).
- ``TEColumnParallelLinear`` / ``TERowParallelLinear`` (``linear_proj``, ``linear_q_proj``, the
  shared experts' and a dense MLP's ``linear_fc2``): as the local column / row adapters.
- ``TELinear`` "duplicated" (MLA's ``linear_q_down_proj`` / ``linear_kv_down_proj``: the whole weight on
  every TP rank, the sequence-parallel input local): whole A and B; with sequence parallelism each
  rank sees its own tokens, so dA and dB are summed over TP (the base weight's ``sequence_parallel``
  reduction, done here in autograd like the other adapters).
- ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` (``TEGroupedMLP``'s fc1 / fc2, one
  GEMM per local expert): one adapter per expert, ``lora_A<i>`` / ``lora_B<i>`` beside TE's
  ``weight<i>`` (global expert index in the global name, ``param_names.global_names``), applied to
  expert i's rows of the permuted tokens (``m_splits``); explicit expert communication as the local
  experts. Checkpoints key them as megatron keys the grouped weights (``experts.linear_fc1.lora_A``
  with the global expert axis, as the local spec's experts), so a checkpoint reads into another EP / TP
  layout. Each expert is an :class:`ExpertAdapter` for the export, the adapter sync and the PEFT writer.
  The adapters run as two small GEMMs per local expert (a loop, rank r wide); a grouped GEMM for them
  (TE's ``general_grouped_gemm``) is the next step for speed, to be measured on a GPU first.

FP8 (``model.fp8``) stays refused with LoRA: TE would quantize the base GEMM's input, not the adapter's.
"""

from __future__ import annotations

import torch

from gspo_megatron.models.lora_base import (
    LoraMixin,
    LoraOptions,
    attach_merge,
    column_delta,
    group_size,
    new_adapter,
    row_delta,
    sharded_with_adapters,
    sum_grad,
)

COLUMN_AXES = {"weight": 0, "bias": 0, "lora_B": 0}
ROW_AXES = {"weight": 1, "lora_A": 1}


class ExpertAdapter:
    """Expert ``i`` of a LoRA grouped linear, with the attributes every adapter has (lora_base)."""

    def __init__(self, module, i: int, global_name: str, full_in: int, full_out: int):
        self.module, self.i = module, i
        self.lora_global_name = global_name
        self.lora_full_in, self.lora_full_out = full_in, full_out

    weight = property(lambda self: getattr(self.module, f"weight{self.i}"))
    lora_A = property(lambda self: getattr(self.module, f"lora_A{self.i}"))
    lora_B = property(lambda self: getattr(self.module, f"lora_B{self.i}"))
    lora_scaling = property(lambda self: self.module.lora_scaling)
    lora_column = property(lambda self: self.module.lora_column)
    lora_tp_group = property(lambda self: self.module.lora_tp_group)
    lora_gated = property(lambda self: self.module.lora_gated)


def _ln_column_class():
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    class LoraTELayerNormColumnParallelLinear(LoraMixin, TELayerNormColumnParallelLinear):
        """TE's norm + column linear, plus ``s B_t (A norm(x))`` (module docstring)."""

        def forward(self, x):
            res = super().forward(x)  # TE returns the norm output too (return_layernorm_output)
            if self.te_return_bias:
                out, bias, ln = res
            else:
                (out, ln), bias = res
            delta = column_delta(self, self._lora_input(ln), expert=False, sequence_parallel=self.sequence_parallel)
            return out + delta, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded_with_adapters(self, prefix, sharded_offsets, metadata, COLUMN_AXES, self._tp_group)

    return LoraTELayerNormColumnParallelLinear


def _column_class():
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    class LoraTEColumnParallelLinear(LoraMixin, TEColumnParallelLinear):
        """TE's column linear + ``s B_t (A x)``."""

        def forward(self, x):
            out, bias = super().forward(x)
            delta = column_delta(
                self, self._lora_input(x), expert=self.lora_expert, sequence_parallel=self.sequence_parallel
            )
            return out + delta, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded_with_adapters(self, prefix, sharded_offsets, metadata, COLUMN_AXES, self._tp_group)

    return LoraTEColumnParallelLinear


def _row_class():
    from megatron.core.extensions.transformer_engine import TERowParallelLinear

    class LoraTERowParallelLinear(LoraMixin, TERowParallelLinear):
        """TE's row linear + ``s B (sum_t A_t x_t)``."""

        def forward(self, x):
            out, bias = super().forward(x)
            delta = row_delta(
                self, self._lora_input(x), expert=self.lora_expert, sequence_parallel=self.sequence_parallel
            )
            return out + delta, bias

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            return sharded_with_adapters(self, prefix, sharded_offsets, metadata, ROW_AXES, self._tp_group)

    return LoraTERowParallelLinear


def _duplicated_class():
    from megatron.core.extensions.transformer_engine import TELinear

    class LoraTELinear(LoraMixin, TELinear):
        """TE's duplicated linear + ``s B (A x)``, dA / dB summed over TP under sequence parallelism."""

        def forward(self, x):
            out, bias = super().forward(x)
            A, B = self.lora_A, self.lora_B
            if self.lora_sp_group is not None:
                A, B = sum_grad(A, self.lora_sp_group), sum_grad(B, self.lora_sp_group)
            h = torch.nn.functional.linear(self._lora_input(x), A)
            return out + torch.nn.functional.linear(h, B) * self.lora_scaling, bias

    return LoraTELinear


def _grouped_sharded(module, out: dict, prefix, sharded_offsets, metadata) -> dict:
    """Add each expert's adapters to the grouped linear's sharded state dict, keyed as the local spec
    keys them (megatron's ``TEGroupedLinear._sharded_state_dict_grouped``, for lora_A / lora_B)."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
    from megatron.core.utils import get_pg_rank, get_pg_size

    singleton = (metadata or {}).get("singleton_local_shards", False)
    pgs = module._pg_collection
    n_global = get_pg_size(pgs.ep) * module.num_gemms
    first = get_pg_rank(pgs.ep) * module.num_gemms
    edp = get_pg_rank(pgs.expt_dp)
    split = "lora_B" if module.lora_column else "lora_A"
    for i in range(module.num_gemms):
        g = first + i
        offsets = sharded_offsets if singleton else (*sharded_offsets, (len(sharded_offsets), g, n_global))
        state = {f"{i}.lora_A": getattr(module, f"lora_A{i}"), f"{i}.lora_B": getattr(module, f"lora_B{i}")}
        axis = {f"{i}.{split}": 0 if module.lora_column else 1}
        sub = make_sharded_tensors_for_checkpoint(
            state, "", axis, offsets, tp_group=module._tp_group, dp_cp_group=metadata["dp_cp_group"]
        )
        replace_prefix_for_sharding(sub, f"{i}.", f"{g}.{prefix}" if singleton else prefix)
        for k in ("lora_A", "lora_B"):
            sh = sub[f"{i}.{k}"]
            sh.replica_id = (*sh.replica_id[:2], edp)  # replicated along expert-DP, as the weights
            if k == "lora_B" and module.lora_gated:
                sh = apply_swiglu_sharded_factory(sh, offsets, singleton)
            out[f"{prefix}{k}{i}"] = sh
    return out


def _grouped_class(base_name: str):
    from megatron.core.extensions import transformer_engine as te_ext

    base = getattr(te_ext, base_name)

    class LoraGrouped(base):  # type: ignore[valid-type, misc]  # a TE wrapper class, looked up by name
        """TE's grouped expert linear + one adapter per expert on its rows of the permuted tokens."""

        def forward(self, x, m_splits):
            out, bias = super().forward(x, m_splits)
            xs = torch.split(self._lora_input(x), [int(n) for n in m_splits])
            delta = column_delta if self.lora_column else row_delta
            parts = [delta(ad, xi, expert=True, sequence_parallel=False) for ad, xi in zip(self.lora_experts, xs)]
            return out + torch.cat(parts).to(out.dtype), bias

        _lora_input = LoraMixin._lora_input

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            return _grouped_sharded(self, out, prefix, sharded_offsets, metadata)

    LoraGrouped.__name__ = LoraGrouped.__qualname__ = "Lora" + base_name
    return LoraGrouped


_CLASSES: dict[type, type] = {}


def te_lora_classes() -> dict[type, type]:
    """{TE wrapper class: its LoRA subclass}, built once (TE and megatron imported lazily)."""
    if not _CLASSES:
        from megatron.core.extensions import transformer_engine as te_ext

        for cls in (_ln_column_class(), _column_class(), _row_class(), _duplicated_class()):
            _CLASSES[cls.__mro__[2]] = cls  # (LoRA class, LoraMixin, the TE wrapper, ...)
        for base in ("TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear"):
            _CLASSES[getattr(te_ext, base)] = _grouped_class(base)
    return _CLASSES


def _wrap_grouped(module, name: str, gnames: dict, opts: LoraOptions, gated: bool) -> int:
    """One adapter per local expert of a grouped linear (each ``weight<i>``: this rank's shard, TE's
    explicit expert split over the expert-TP group); returns how many."""
    column = "Column" in type(module).__name__
    group = module._tp_group
    module.lora_scaling, module.lora_dropout = opts.scaling, float(opts.dropout)
    module.lora_column, module.lora_tp_group, module.lora_gated = column, group, gated
    module.lora_experts = []
    for i in range(module.num_gemms):
        gname = gnames[f"{name}.weight{i}"]
        A, B, full_in, full_out = new_adapter(getattr(module, f"weight{i}"), opts, gname, column=column, group=group)
        module.register_parameter(f"lora_A{i}", A)
        module.register_parameter(f"lora_B{i}", B)
        ad = ExpertAdapter(module, i, gname, full_in, full_out)
        attach_merge(ad)
        module.lora_experts.append(ad)
    return module.num_gemms


def wrap_te(module, name: str, gnames: dict, opts: LoraOptions) -> int | None:
    """Turn ``module`` (a TE wrapper, at ``name``) into its LoRA subclass with fresh adapters; returns
    how many adapters it got, or None when it is no TE linear this file wraps. The adapter's sizes follow
    from the weight shard (``lora_base.new_adapter``): a TE row linear's split like W's columns, any
    other's like W's rows, over the layer's TP group; a duplicated ``TELinear``'s whole (no group)."""
    cls = te_lora_classes().get(type(module))
    if cls is None:
        return None
    kind = type(module).__name__
    gated = name.endswith("linear_fc1") and bool(module.config.gated_linear_unit)
    module.__class__ = cls
    if "Grouped" in kind:
        return _wrap_grouped(module, name, gnames, opts, gated)
    gname = gnames[f"{name}.weight"]
    routed = ".experts." in name and ".shared_experts." not in name
    module.lora_expert = routed and module.parallel_mode is None  # TE's comm handed to the dispatcher
    if kind == "TELinear" and module.parallel_mode is None and not routed:  # duplicated: whole A, B
        module._init_lora(opts, gname, column=True, tp_group=None, gated=False)
        sp = module.config.sequence_parallel and group_size(module._tp_group) > 1
        module.lora_sp_group = module._tp_group if sp else None
        return 1
    column = kind != "TERowParallelLinear"
    module._init_lora(opts, gname, column=column, tp_group=module._tp_group, gated=gated and column)
    if kind == "TELayerNormColumnParallelLinear":
        module.return_layernorm_output = True  # TE hands the adapter its own norm's output (docstring)
        module.return_layernorm_output_gathered = False
    return 1
