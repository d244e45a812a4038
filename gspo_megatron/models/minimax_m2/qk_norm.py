"""MiniMax-M2's q/k RMSNorm over the whole projection width, tensor-parallel, for Megatron-Core.

transformers (``MiniMaxM2Attention``) normalizes the query projection as ONE vector per token:

    q = q_proj(x)                                   # [tokens, Hq * d]   (Hq heads of size d)
    q = q * rsqrt(mean_{j < Hq*d}(q_j^2) + eps)     # one mean over all heads together
    q = w_q * q                                     # w_q: [Hq * d]  (q_norm.weight)

and the keys likewise over ``Hkv * d`` (``k_norm.weight`` [Hkv * d]), before RoPE.

Why Megatron-Core's own ``qk_layernorm`` falls short: its ``q_layernorm`` / ``k_layernorm`` are
built with ``hidden_size = head_dim`` and applied to ``query`` [sq, b, heads, d] along the last dim,
i.e. one mean of squares and one weight [d] PER HEAD (Qwen3's per-head norm). MiniMax-M2's norm
mixes all heads into one statistic and has a weight per (head, channel). Under tensor parallelism
the heads are split over the TP ranks, so no rank sees the whole vector: a local norm would use a
per-rank statistic. And with ``config.qk_layernorm`` set, ``finalize_model_grads`` sums every
``q_layernorm`` / ``k_layernorm`` gradient over TP (right for a replicated per-head weight, wrong for
a weight whose slices differ per rank): the family builds with ``qk_layernorm=False`` and puts
:class:`FullWidthRMSNorm` into the two slots (``use_full_width_qk_norm``), so the parameters keep the
names ``self_attention.{q,k}_layernorm.weight`` without Megatron's by-name TP reduction.

TP: rank r holds heads [r*H/tp, (r+1)*H/tp) (Megatron's fused QKV splits whole query groups; the
query heads of a group are contiguous in HF's q_proj rows), so its slice of the norm weight is rows
[r*H*d/tp, (r+1)*H*d/tp) of the HF weight (``mapping``: ``ColumnParallel``, like q/k rows). The
statistic is

    ms = (1 / (H * d)) * allreduce_sum_TP( sum_{local j} q_j^2 )      # [sq, b, 1] on every rank

through an autograd all-reduce whose backward is again an all-reduce sum: each rank's downstream
only carries the gradient of its own heads, and d loss / d ms is the sum of those over the ranks.
The weight is marked tensor-parallel (partition dim 0): the gradient-norm counts each slice once,
its gradient is complete on its rank (no TP reduction), and the distributed checkpoint stores it
TP-sharded (``sharded_state_dict``). Requires ``num_key_value_heads % tp == 0`` (Megatron's
``num_query_groups % tp`` check): no rank holds a replicated key head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _AllReduceSum(torch.autograd.Function):
    """y = sum over the group of x (every rank gets y); dx = sum over the group of dy."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class FullWidthRMSNorm(nn.Module):
    """RMSNorm over all heads of q (``which="q"``: ``num_attention_heads`` heads) or k (``"k"``:
    ``num_query_groups`` heads) of one token, on this rank's heads; see the module docstring.

    Built by Megatron's ``SelfAttention`` as ``q_layernorm(hidden_size=head_dim, config, eps)``.
    Input / output: [sq, b, heads / tp, head_dim]. Weight: [heads / tp * head_dim] (this rank's rows).
    Computed as transformers does: in fp32, ``weight * (x * rsqrt(ms + eps)).to(input dtype)``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, which: str = "q"):
        super().__init__()
        heads = config.num_attention_heads if which == "q" else config.num_query_groups
        tp = config.tensor_model_parallel_size
        if heads % tp:
            raise ValueError(
                f"{which} heads ({heads}) must divide over tensor parallel size {tp} for the full-width q/k norm"
            )
        self.which, self.head_dim, self.eps, self.tp = which, hidden_size, float(eps), tp
        self.width = heads * hidden_size  # the full (all-rank) normalized width
        self.weight = nn.Parameter(torch.ones(heads // tp * hidden_size, dtype=config.params_dtype))
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def _tp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        h = x.reshape(*shape[:-2], shape[-2] * shape[-1]).to(torch.float32)
        if self.tp == 1:
            ms = h.pow(2).mean(-1, keepdim=True)
        else:
            ms = _AllReduceSum.apply(h.pow(2).sum(-1, keepdim=True), self._tp_group()) / self.width
        h = h * torch.rsqrt(ms + self.eps)
        return (self.weight * h.to(dtype)).reshape(shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight TP-sharded along dim 0 (Megatron's default for a plain module is replicated)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets
        )

    def extra_repr(self) -> str:
        return f"{self.which}, local {tuple(self.weight.shape)} of width {self.width}, eps={self.eps}"


def use_full_width_qk_norm(block_spec) -> int:
    """Put :class:`FullWidthRMSNorm` into the ``q_layernorm`` / ``k_layernorm`` slots of every layer's
    self-attention in a decoder block spec (in place; local and Transformer Engine specs alike).
    Returns how many layers it changed."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    n = 0
    for layer in block_spec.layer_specs:
        sub = layer.submodules.self_attention.submodules
        sub.q_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"which": "q"})
        sub.k_layernorm = ModuleSpec(module=FullWidthRMSNorm, params={"which": "k"})
        n += 1
    return n
