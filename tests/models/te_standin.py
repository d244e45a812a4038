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
megatron-core's autograd-aware ``tensor_parallel.mappings``, so backward runs too): ``Linear``
"column" all-gathers its input over the sequence with ``sequence_parallel`` (TE's
``gather_along_first_dim``; backward reduce-scatter) and without it all-reduces the input gradient,
"row" all-reduces its output (reduce-scatters it over the sequence with ``sequence_parallel``), None
("duplicated" and TE with its communication handed to megatron, the experts) does neither; the bias
is added after the reduction, or returned with ``return_bias``; ``LayerNormLinear`` normalizes first
(TE's reference ``ops/basic/rmsnorm.py`` ``op_onnx_forward`` / ``layernorm.py``: eps, zero-centered
gamma), gathers the normalized input, and returns the (local) normalized input too with
``return_layernorm_output`` (the gathered form refused: TE's backward drops its gradient);
``GroupedLinear`` runs gemm i on the i-th ``m_splits`` rows; ``RMSNorm`` / ``LayerNorm`` as that
reference; ``DotProductAttention`` by TE's unfused reference (causal or padded "sbhd", causal per
segment "thd"); ``cpp_extensions.general_gemm`` (the MoE router's gating GEMM) forward and backward;
``attention._SplitAlongDim`` (the fused qkv split); ``optimizers.FusedAdam`` as torch's AdamW and the
multi-tensor kernels by megatron-core's torch references; TE's quantized tensor classes as real
classes nothing is an instance of (no FP8).

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
    def __init__(self):
        super().__init__()
        # TransformerEngineBaseModule.__init__ (module/base.py): no FP8 state; megatron's grouped
        # linear reads these when it splits the extra state per expert for a checkpoint
        self.fp8, self.fp8_calibration = False, False
        self.fp8_meta = {"fp8_checkpoint": False}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """TE sets up its FP8 scaling state here; without FP8 there is none."""

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
        x = mappings.gather_from_sequence_parallel_region(x, group=group)  # backward: reduce-scatter
    elif module.parallel_mode == "column" and group is not None and group.size() > 1:
        x = mappings.copy_to_tensor_model_parallel_region(x, group=group)  # backward: all-reduce dgrad
    out = torch.nn.functional.linear(x, weight)
    if module.parallel_mode == "row" and group is not None and group.size() > 1:
        if module.sequence_parallel:
            out = mappings.reduce_scatter_to_sequence_parallel_region(out, group=group)  # backward: all-gather
        else:
            out = mappings.reduce_from_tensor_model_parallel_region(out, group=group)  # backward: identity
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
        return_layernorm_output=False,
        return_layernorm_output_gathered=False,
        **kw,
    ):
        # TE registers the norm before the weight; the order of named_parameters does not matter here
        super().__init__(in_features, out_features, params_dtype=params_dtype, **kw)
        self.eps, self.normalization, self.zero_centered_gamma = eps, normalization, zero_centered_gamma
        self.return_layernorm_output = return_layernorm_output
        self.return_layernorm_output_gathered = return_layernorm_output_gathered and return_layernorm_output
        self.layer_norm_weight = nn.Parameter(torch.ones(in_features, dtype=params_dtype))
        if normalization != "RMSNorm":
            self.layer_norm_bias = nn.Parameter(torch.zeros(in_features, dtype=params_dtype))
        else:
            self.layer_norm_bias = None

    def forward(self, inp, is_first_microbatch=None, **_):
        rms = self.normalization == "RMSNorm"
        ln = _norm(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.zero_centered_gamma, rms)
        out = _linear_forward(self, ln, self.weight, self.bias)
        if not self.return_layernorm_output:
            return out
        if self.return_layernorm_output_gathered:  # TE drops this output's gradient (module docstring)
            raise NotImplementedError("te_standin.LayerNormLinear: return_layernorm_output_gathered")
        return (*out, ln) if self.return_bias else (out, ln)


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
    """TE's attention (attention.py ``DotProductAttention``) by its unfused reference: fp32 scores,
    ``softmax_scale`` (default 1/sqrt(qk head dim)), GQA by repeating each key/value group, no dropout.
    ``qkv_format`` "sbhd" (q [s, b, h, d] -> [s, b, h * d_v]) with ``attn_mask_type`` "causal"
    (top-left), "no_mask" or "padding*" with a boolean ``attention_mask`` (True = masked); "thd"
    (q [t, h, d] -> [t, h * d_v]) causal within each ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``)
    segment, as TE's "padding_causal"."""

    def __init__(self, num_attention_heads, kv_channels, attention_dropout=0.0, softmax_scale=None, **_):
        super().__init__()
        qk = kv_channels[0] if isinstance(kv_channels, (tuple, list)) else kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else qk**-0.5
        self.attention_dropout = attention_dropout

    def _attend(self, q, k, v, mask) -> torch.Tensor:
        """q [b, h, s, d], k / v [b, g, s, d]; mask [.., s, s] True = masked -> [b, h, s, d_v]."""
        if self.attention_dropout and self.training:
            raise NotImplementedError("te_standin.DotProductAttention: attention dropout")
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q.float() @ k.float().transpose(-1, -2)) * self.softmax_scale
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return (torch.softmax(scores, -1) @ v.float()).to(q.dtype)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        qkv_format="sbhd",
        attn_mask_type="causal",
        cu_seqlens_q=None,
        cu_seqlens_q_padded=None,
        core_attention_bias_type="no_bias",
        **_,
    ):
        if core_attention_bias_type != "no_bias":
            raise NotImplementedError(
                f"te_standin.DotProductAttention: core_attention_bias_type {core_attention_bias_type}"
            )
        if qkv_format == "thd":
            cu = (cu_seqlens_q if cu_seqlens_q_padded is None else cu_seqlens_q_padded).tolist()
            outs = []
            for a, b in zip(cu[:-1], cu[1:]):
                n = b - a
                causal = torch.ones(n, n, dtype=torch.bool, device=query.device).triu(1)
                seg = [t[a:b].transpose(0, 1)[None] for t in (query, key, value)]  # [1, h, n, d]
                outs.append(self._attend(*seg, causal)[0].transpose(0, 1).reshape(n, -1))
            return torch.cat(outs)
        if qkv_format != "sbhd":
            raise NotImplementedError(f"te_standin.DotProductAttention: qkv_format {qkv_format}")
        s = query.shape[0]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
        mask = attention_mask if "padding" in attn_mask_type or attn_mask_type == "arbitrary" else None
        if "causal" in attn_mask_type:
            causal = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)
            mask = causal if mask is None else (mask | causal)
        out = self._attend(q, k, v, mask)  # [b, h, s, d_v]
        return out.permute(2, 0, 1, 3).reshape(s, out.shape[0], -1)


_PYTORCH = (Linear, LayerNormLinear, GroupedLinear, RMSNorm, LayerNorm, DotProductAttention)


def general_gemm(A, B, workspace=None, out_dtype=None, layout="TN", bias=None, grad=False, **_):
    """TE's ``cpp_extensions.general_gemm`` (cpp_extensions/gemm.py; cuBLAS column-major): in row-major
    terms D = op(B) @ op(A), op transposing where ``layout`` says "T" (A first, B second), fp32
    accumulation; the bias added (forward); returns (D, bias grad, gelu input, extra) as TE does.
    megatron-core's router gating (moe_utils.RouterGatingLinearFunction) calls it, forward and (``grad``,
    layouts NN / NT, no bias) backward."""
    if grad and bias is not None:  # TE then returns the bias gradient as well
        raise NotImplementedError("te_standin.general_gemm: grad=True with a bias")
    a = A.float().t() if layout[0] == "T" else A.float()
    b = B.float().t() if layout[1] == "T" else B.float()
    out = b @ a
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or A.dtype), None, None, None


class _SplitAlongDim:
    """TE's ``attention._SplitAlongDim`` (attention/dot_product_attention/utils.py): ``apply(x, dim,
    sizes)`` splits ``x`` along ``dim`` into views of ``sizes``; megatron's attention splits the fused
    qkv with it."""

    @staticmethod
    def apply(x, dim, sizes):
        return torch.split(x, list(sizes), dim=dim)


class FusedAdam(torch.optim.Optimizer):
    """TE's ``optimizers.FusedAdam`` (optimizers/fused_adam.py, its multi-tensor Adam kernel) in plain
    torch: the step count lives in each param group (``group["step"]``, not advanced for an empty group:
    megatron's DistributedOptimizer saves and restores it from there), per-parameter ``exp_avg`` /
    ``exp_avg_sq``; ``adam_w_mode`` (megatron passes ``decoupled_weight_decay``) decays decoupled,
    else as L2 on the gradient: ``p -= lr * ((m / bc1) / (sqrt(v / bc2) + eps) + wd * p)``. No
    precision-aware state (megatron asks for it only with use_precision_aware_optimizer)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        **kw,
    ):
        if kw or amsgrad:
            raise NotImplementedError(f"te_standin.FusedAdam: {sorted(kw) or 'amsgrad'}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            (b1, b2), t, wd = group["betas"], group["step"], group["weight_decay"]
            bc1, bc2 = (1 - b1**t, 1 - b2**t) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                g = p.grad if self.adam_w_mode or not wd else p.grad + wd * p
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                update = (state["exp_avg"] / bc1) / ((state["exp_avg_sq"] / bc2).sqrt() + group["eps"])
                if self.adam_w_mode and wd:
                    update = update + wd * p
                p.add_(update, alpha=-group["lr"])


def _megatron_local(name: str):
    """TE's multi-tensor kernels (optimizers/multi_tensor_apply.py) by megatron-core's own torch
    references (``megatron.core.utils.local_multi_tensor_*``, what it falls back to without TE/apex)."""

    def call(*args, **kwargs):
        from megatron.core import utils

        return getattr(utils, name)(*args, **kwargs)

    return call


class QuantizedTensor(torch.Tensor):
    """TE's quantized tensor classes (tensor/quantized_tensor.py, float8_tensor.py, mxfp8_tensor.py):
    real classes, so megatron's ``isinstance`` checks (``fp8_utils.is_float8tensor``) answer False for
    every tensor here (no FP8)."""


_TENSOR_CLASSES = {
    "transformer_engine.pytorch.tensor": {"QuantizedTensor": QuantizedTensor},
    "transformer_engine.pytorch.float8_tensor": {"Float8Tensor": QuantizedTensor},
    "transformer_engine.pytorch.tensor.float8_tensor": {"Float8Tensor": QuantizedTensor},
    "transformer_engine.pytorch.tensor.mxfp8_tensor": {"MXFP8Tensor": QuantizedTensor},
}


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
        elif spec.name == "transformer_engine.pytorch.optimizers":
            m.FusedAdam, m.FusedSGD = FusedAdam, torch.optim.SGD
            m.multi_tensor_applier = _megatron_local("local_multi_tensor_applier")
            m.multi_tensor_l2norm = _megatron_local("local_multi_tensor_l2_norm")
            m.multi_tensor_scale = _megatron_local("local_multi_tensor_scale")
        elif spec.name in _TENSOR_CLASSES:
            for k, v in _TENSOR_CLASSES[spec.name].items():
                setattr(m, k, v)
        elif spec.name == "transformer_engine.pytorch.attention":
            m._SplitAlongDim = _SplitAlongDim
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
