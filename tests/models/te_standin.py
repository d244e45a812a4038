"""A stand-in for the Transformer Engine package on machines without it (CPU), so that megatron-core
0.16.1's own TE layer spec and TE wrappers (``megatron/core/extensions/transformer_engine.py``:
TELinear, TELayerNormColumnParallelLinear, TEColumnParallelLinear, TERowParallelLinear, TENorm,
TEDotProductAttention, TEGroupedLinear / TEGroupedMLP) build a model whose parameters have TE's names
and per-rank shapes. Only the base classes megatron subclasses are written here, each registering
the parameters TE 2.20 registers (source read: NVIDIA/TransformerEngine, transformer_engine/pytorch/):

- ``Linear`` (module/linear.py): ``weight`` [out, in], ``out`` divided by the TP size for
  ``parallel_mode="column"``, ``in`` for "row", whole for None (megatron's "duplicated");
  ``reset_parameters`` marks it ``tensor_model_parallel=True`` (partition dim 1 for row, else 0)
  whatever the mode; ``bias`` a parameter only when asked, else an empty plain tensor;
- ``LayerNormLinear`` (module/layernorm_linear.py): ``layer_norm_weight`` [in] (+ ``layer_norm_bias``
  unless RMSNorm) then ``weight`` as Linear;
- ``GroupedLinear`` (module/grouped_linear.py): ``weight0`` .. ``weight{num_gemms-1}``, each [out, in]
  split like Linear;
- ``RMSNorm`` / ``LayerNorm`` (what ``TENorm`` returns): ``weight`` [hidden] (+ ``bias``);
- ``DotProductAttention``: no parameter (vanilla softmax);
- every module's ``get_extra_state`` (module/base.py): an empty uint8 tensor without FP8, so state
  dicts hold ``<module>._extra_state`` as with TE.
Every other ``transformer_engine.*`` name is a MagicMock (as megatron-core itself does without TE).

Forwards (plain torch, fp32 maths; what TE's modules compute without FP8, its communication done with
megatron-core's ``tensor_parallel.mappings``): ``Linear`` "column" all-gathers its input over the
sequence with ``sequence_parallel`` (TE's ``gather_along_first_dim``), "row" all-reduces its output
(reduce-scatters it over the sequence with ``sequence_parallel``), None ("duplicated" and TE with its
communication handed to megatron, the experts) does neither; the bias is added after the
reduction, or returned with ``return_bias``; ``LayerNormLinear`` normalizes first (TE's reference
``ops/basic/rmsnorm.py`` ``op_onnx_forward`` / ``layernorm.py``: eps, zero-centered gamma) and
gathers the normalized input; ``GroupedLinear`` runs gemm i on the i-th ``m_splits`` rows;
``RMSNorm`` / ``LayerNorm`` as that reference; ``cpp_extensions.general_gemm`` (the MoE router's
gating GEMM) forward only. ``DotProductAttention`` has no forward (TE's fused
kernels): a model whose core attention is TE's cannot run here; DSA's core attention is ours.

``install()`` must run before anything imports megatron (a fresh process: a rank of
``distributed_harness.run_ranks``); ``build_model`` then needs ``use_transformer_engine`` to say yes
(``patch_build``).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from unittest.mock import MagicMock

import torch
from torch import nn

TE_VERSION = "2.20.2"  # the pinned transformer-engine (pyproject.toml's gpu extra)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _tp_size(tp_group, tp_size: int) -> int:
    """TE: ``tp_size`` when no group is given, else the group's size (module/linear.py)."""
    return tp_size if tp_group is None else torch.distributed.get_world_size(tp_group)


def _split(in_f: int, out_f: int, parallel_mode, n: int) -> tuple[int, int]:
    if parallel_mode == "column":
        return in_f, out_f // n
    if parallel_mode == "row":
        return in_f // n, out_f
    return in_f, out_f


class _TEBase(nn.Module):
    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass


def _norm(x, weight, bias, eps: float, zero_centered_gamma: bool, rms: bool) -> torch.Tensor:
    """TE's normalization reference (ops/basic/rmsnorm.py, layernorm.py ``op_onnx_forward``), fp32."""
    w = weight.float() + 1 if zero_centered_gamma else weight.float()
    x32 = x.float()
    if rms:
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w
    else:
        y = torch.nn.functional.layer_norm(x32, x32.shape[-1:], w, bias.float(), eps)
    return y.to(x.dtype)


def _linear_forward(module, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """``Linear`` / ``LayerNormLinear``'s GEMM and TP communication (module docstring)."""
    from megatron.core.tensor_parallel import mappings

    group = module.tp_group
    if module.parallel_mode == "column" and module.sequence_parallel:
        x = mappings._gather_along_first_dim(x, group)
    out = torch.nn.functional.linear(x, weight)
    if module.parallel_mode == "row" and group is not None and group.size() > 1:
        if module.sequence_parallel:
            out = mappings._reduce_scatter_along_first_dim(out, group)
        else:
            out = mappings._reduce(out, group)
    if module.use_bias and not module.return_bias:
        out = out + bias
    return (out, bias if module.use_bias else None) if module.return_bias else out


class Linear(_TEBase):
    def __init__(
        self,
        in_features,
        out_features,
        sequence_parallel=False,
        tp_group=None,
        tp_size=1,
        bias=True,
        parallel_mode=None,
        params_dtype=None,
        return_bias=False,
        **_,
    ):
        super().__init__()
        self.parallel_mode, self.tp_group, self.return_bias = parallel_mode, tp_group, return_bias
        n = _tp_size(tp_group, tp_size)
        self.in_features, self.out_features = _split(in_features, out_features, parallel_mode, n)
        self.sequence_parallel, self.use_bias = n > 1 and sequence_parallel, bias
        self.weight = nn.Parameter(torch.zeros(self.out_features, self.in_features, dtype=params_dtype))
        # reset_parameters: set_tensor_model_parallel_attributes(is_parallel=True, ...) for every mode
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 1 if parallel_mode == "row" else 0
        self.weight.partition_stride = 1
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=params_dtype))
        else:
            self.bias = torch.Tensor()

    def forward(self, inp, is_first_microbatch=None, **_):
        return _linear_forward(self, inp, self.weight, self.bias)


class LayerNormLinear(Linear):
    def __init__(
        self,
        in_features,
        out_features,
        eps=1e-5,
        normalization="LayerNorm",
        zero_centered_gamma=False,
        params_dtype=None,
        **kw,
    ):
        # TE registers the norm before the weight; the order of named_parameters does not matter here
        super().__init__(in_features, out_features, params_dtype=params_dtype, **kw)
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, dtype=params_dtype))
        if normalization != "RMSNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, dtype=params_dtype))
        else:
            self.layer_norm_bias = None

    def forward(self, inp, is_first_microbatch=None, **_):
        rms = self.normalization == "RMSNorm"
        ln = _norm(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma, rms)
        return _linear_forward(self, ln, self.weight, self.bias)


class GroupedLinear(_TEBase):
    def __init__(
        self,
        num_gemms,
        in_features,
        out_features,
        tp_group=None,
        tp_size=1,
        bias=True,
        params_dtype=None,
        parallel_mode=None,
        return_bias=False,
        **_,
    ):
        super().__init__()
        self.num_gemms, self.parallel_mode, self.use_bias = num_gemms, parallel_mode, bias
        self.return_bias = return_bias
        if parallel_mode is not None and _tp_size(tp_group, tp_size) > 1:
            raise NotImplementedError("te_standin.GroupedLinear: TE-side TP communication (megatron hands it over)")
        n = _tp_size(tp_group, tp_size)
        self.in_features, self.out_features = _split(in_features, out_features, parallel_mode, n)
        for i in range(num_gemms):
            w = nn.Parameter(torch.zeros(self.out_features, self.in_features, dtype=params_dtype))
            self.register_parameter(f"weight{i}", w)
            if bias:
                self.register_parameter(f"bias{i}", nn.Parameter(torch.zeros(self.out_features, dtype=params_dtype)))
            else:
                setattr(self, f"bias{i}", torch.Tensor())

    def forward(self, inp, m_splits, is_first_microbatch=None, **_):
        parts = torch.split(inp, list(m_splits))
        outs = [torch.nn.functional.linear(p, getattr(self, f"weight{i}")) for i, p in enumerate(parts)]
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        if self.use_bias and not self.return_bias:
            outs = [o + b for o, b in zip(outs, biases)]
        out = torch.cat(outs)
        return (out, biases if self.use_bias else None) if self.return_bias else out


class RMSNorm(_TEBase):
    def __init__(self, hidden_size, eps=1e-5, params_dtype=None, zero_centered_gamma=False, **_):
        super().__init__()
        self.eps, self.zero_centered_gamma = eps, zero_centered_gamma
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype))

    def forward(self, inp):
        return _norm(inp, self.weight, getattr(self, "bias", None), self.eps, self.zero_centered_gamma, True)


class LayerNorm(RMSNorm):
    def __init__(self, hidden_size, eps=1e-5, params_dtype=None, zero_centered_gamma=False, **_):
        super().__init__(hidden_size, eps, params_dtype, zero_centered_gamma)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype))

    def forward(self, inp):
        return _norm(inp, self.weight, self.bias, self.eps, self.zero_centered_gamma, False)


class DotProductAttention(_TEBase):
    def __init__(self, *_, **__):
        super().__init__()


_PYTORCH = (Linear, LayerNormLinear, GroupedLinear, RMSNorm, LayerNorm, DotProductAttention)


def general_gemm(A, B, workspace=None, out_dtype=None, layout="TN", bias=None, grad=False, **_):
    """TE's ``cpp_extensions.general_gemm`` (cpp_extensions/gemm.py; cuBLAS column-major): in row-major
    terms D = op(B) @ op(A), op transposing where ``layout`` says "T" (A first, B second), fp32
    accumulation; the bias added (forward); returns (D, bias grad, gelu input, extra) as TE does.
    megatron-core's router gating (moe_utils.RouterGatingLinearFunction) calls it."""
    if grad:
        raise NotImplementedError("te_standin.general_gemm: forward only")
    a = A.float().t() if layout[0] == "T" else A.float()
    b = B.float().t() if layout[1] == "T" else B.float()
    out = b @ a
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or A.dtype), None, None, None


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``transformer_engine`` and every submodule (``_Module``s) with the classes above."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformer_engine", "transformer_engine_torch"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Module(spec.name)
        m.__path__ = []
        if spec.name == "transformer_engine":
            m.__version__ = TE_VERSION
        elif spec.name == "transformer_engine.pytorch":
            for cls in _PYTORCH:
                setattr(m, cls.__name__, cls)
        elif spec.name == "transformer_engine.pytorch.cpp_extensions":
            m.general_gemm = general_gemm
        elif spec.name == "transformer_engine.pytorch.cpu_offload":  # off: (no-op context, identity)
            m.get_cpu_offload_context = lambda *a, **k: (contextlib.nullcontext(), lambda x: x)
        return m

    def exec_module(self, module):
        pass


def install() -> None:
    """Put the stand-in on the import path (once); refuses once megatron is imported (too late)."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    if any(m == "megatron.core" or m.startswith("megatron.core.") for m in sys.modules):
        raise RuntimeError("te_standin.install() must run before megatron.core is imported")
    sys.meta_path.insert(0, _Finder())


def patch_build() -> None:
    """``models.build.use_transformer_engine``: TE for every impl but ``local`` (no CUDA check)."""
    from gspo_megatron.models import build

    build.use_transformer_engine = lambda impl: impl != "local"
