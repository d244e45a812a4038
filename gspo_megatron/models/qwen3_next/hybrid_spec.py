"""The Gated DeltaNet hybrid decoder on Megatron-Core's GPT stack (Qwen3-Next, Qwen3.5-MoE).

How the hybrid stack is built: Megatron-Core 0.16.1's own hybrid block spec
(``experimental_attention_variant_module_specs.get_transformer_block_with_experimental_attention_variant_spec``)
asserts ``transformer_impl == "transformer_engine"``, so it cannot serve the CPU (local) spec. Instead
the GPT decoder block spec keeps one layer spec per layer and its ``self_attention`` slot becomes
:class:`HybridMixer`, which builds, per *global* layer number (pipeline stages included), either the
gated full attention (Megatron's ``SelfAttention`` with ``attention_output_gate``) or
:class:`PackedGatedDeltaNet` (Megatron-Core's ``ssm.gated_delta_net.GatedDeltaNet``: its parameters,
initialization and TP-sharded distributed-checkpoint layout; a forward that also takes packed
sequences and calls ``kernels.py``). The pattern is ``config.linear_attention_freq`` (a list: 1 =
linear attention), Megatron's own field.

Norms: Qwen3-Next's RMSNorm is zero-centered, ``y = x / rms(x) * (1 + w)`` computed in fp32 (weights
stored as w, initialized to zero): Megatron's ``layernorm_zero_centered_gamma`` (Transformer Engine's
norms honor it; the local spec's ``WrappedTorchNorm`` refuses it, so the local spec gets
:class:`ZeroCenteredRMSNorm` in every norm slot). The Gated DeltaNet output norm is a plain RMSNorm
(``y = w * x / rms(x)``, per value head, then ``* silu(z)``): :class:`PlainRMSNorm` on both specs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gspo_megatron.models.packed_attention import packed_cu_seqlens
from gspo_megatron.models.qwen3_next.kernels import causal_conv1d, chunk_gated_delta_rule, l2norm
from gspo_megatron.runtime.scoped_attrs import module_attrs


class _RMSNorm(nn.Module):
    """RMSNorm over the last dim in fp32, built as Megatron builds norms:
    ``(config, hidden_size, eps)``; weight [hidden_size]."""

    zero_centered = False

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = float(eps)
        init = torch.zeros if self.zero_centered else torch.ones
        self.weight = nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        # replicated over TP; with sequence parallelism each TP rank sees other tokens (or other heads, for
        # q/k and the Gated DeltaNet output norm), so Megatron sums the gradient over TP (finalize_model_grads)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def _normed(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered={self.zero_centered}"


class ZeroCenteredRMSNorm(_RMSNorm):
    """transformers' ``Qwen3NextRMSNorm``: ``(norm(x.float()) * (1 + w.float())).type_as(x)``."""

    zero_centered = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._normed(x) * (1.0 + self.weight.float())).type_as(x)


class PlainRMSNorm(_RMSNorm):
    """transformers' ``Qwen3NextRMSNormGated`` before the gate: ``w * norm(x.float()).to(x.dtype)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self._normed(x).to(x.dtype)


def _gated_delta_net_class():
    from megatron.core.ssm import gated_delta_net as mgdn

    class PackedGatedDeltaNet(mgdn.GatedDeltaNet):
        """Megatron-Core's Gated DeltaNet layer (parameters ``in_proj`` [(2*Hk*dk + 2*Hv*dv + 2*Hv) / tp, h]
        with rows [q | k | v | z | beta | alpha] of this rank's heads, ``conv1d`` [(2*Hk*dk + Hv*dv) / tp, 1, K],
        ``dt_bias`` / ``A_log`` [Hv / tp], ``out_norm`` [dv], ``out_proj`` [h, Hv*dv / tp]) whose forward runs
        without flash-linear-attention (``kernels.py``) and takes THD ``packed_seq_params``.

        Forward, input [s, b, h] (s / tp under sequence parallelism; THD: [t, 1, h]):
            q, k, v, z, b, a = in_proj(x)                     (this rank's heads)
            q, k, v = split(silu(causal_conv1d([q; k; v])))  (zero history at each sequence start)
            q, k = l2norm(q), l2norm(k), repeated to the Hv value heads (head j uses key head j // (Hv/Hk))
            g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
            o = gated_delta_rule(q, k, v, g, beta)            (zero state at each sequence start)
            y = out_proj(out_norm(o) * silu(z))               [s, b, h]
        """

        def __init__(self, config, submodules, layer_number=None, pg_collection=None, **_):
            # the constructor refuses without fla; the forward below does not need it (the flag is set
            # for the constructor only, runtime/scoped_attrs.py)
            with module_attrs(mgdn, HAVE_FLA=True):
                super().__init__(
                    config,
                    submodules,
                    layer_number=layer_number,
                    bias=False,
                    conv_bias=False,
                    use_qk_l2norm=True,
                    pg_collection=pg_collection,
                )
            # Megatron marks these with ``tensor_model_parallel`` only; the optimizer's grad-norm and
            # checkpoint code also read ``partition_dim`` / ``partition_stride`` (split along dim 0)
            for p in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log):
                if p is not None:
                    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1

        def forward(
            self,
            hidden_states,
            attention_mask=None,
            key_value_states=None,
            inference_context=None,
            attention_bias=None,
            packed_seq_params=None,
            sequence_len_offset=None,
            *,
            inference_params=None,
            **kwargs,
        ):
            if inference_context is not None or inference_params is not None:
                raise NotImplementedError("Gated DeltaNet inference (a recurrent cache) is not implemented here")
            seq_len, batch, _ = hidden_states.shape
            seq_len *= self.sp_size
            cu = None
            if packed_seq_params is not None:
                cu = packed_cu_seqlens(packed_seq_params)
            tp = self.tp_size
            qkvzba, _ = self.in_proj(hidden_states)
            qkvzba = qkvzba.transpose(0, 1)  # [b, s, in_proj / tp]
            nv = self.num_value_heads // tp
            qkv, gate, beta, alpha = torch.split(
                qkvzba, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp, nv, nv], dim=-1
            )
            w = self.conv1d.weight.squeeze(1)
            qkv = causal_conv1d(qkv.transpose(1, 2), w, self.conv1d.bias, cu_seqlens=cu).transpose(1, 2)
            query, key, value = torch.split(qkv, [self.qk_dim // tp, self.qk_dim // tp, self.v_dim // tp], dim=-1)
            query = l2norm(query.reshape(batch, seq_len, -1, self.key_head_dim).float()).to(query.dtype)
            key = l2norm(key.reshape(batch, seq_len, -1, self.key_head_dim).float()).to(key.dtype)
            value = value.reshape(batch, seq_len, -1, self.value_head_dim)
            rep = self.num_value_heads // self.num_key_heads
            if rep > 1:
                query, key = query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2)
            g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias.float())
            out = chunk_gated_delta_rule(query, key, value, g, beta.sigmoid(), cu_seqlens=cu)
            dtype = out.dtype
            y = self.out_norm(out.reshape(-1, self.value_head_dim))
            y = (y * F.silu(gate.reshape(-1, self.value_head_dim).float())).to(dtype)
            y = y.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
            return self.out_proj(y)

    return PackedGatedDeltaNet


_GDN = None


def gated_delta_net_class():
    """:class:`PackedGatedDeltaNet` (created on first use: Megatron-Core imports lazily)."""
    global _GDN
    if _GDN is None:
        _GDN = _gated_delta_net_class()
    return _GDN


@dataclass
class HybridMixerSubmodules:
    full: object  # the ModuleSpec of the gated full attention
    linear: object  # the ModuleSpec of the Gated DeltaNet


class HybridMixer:
    """A layer spec's ``self_attention`` slot that builds, for global layer ``layer_number`` (1-based),
    the linear-attention module when ``config.linear_attention_freq[layer_number - 1]`` is 1, else the
    full attention (the returned object is that module; this class is never instantiated)."""

    def __new__(cls, config, submodules: HybridMixerSubmodules, layer_number: int, **kwargs):
        from megatron.core.transformer.spec_utils import build_module

        pattern = config.linear_attention_freq
        if pattern[layer_number - 1]:
            return build_module(
                submodules.linear, config=config, layer_number=layer_number, pg_collection=kwargs.get("pg_collection")
            )
        return build_module(submodules.full, config=config, layer_number=layer_number, **kwargs)


def use_hybrid_layers(block_spec, te: bool) -> int:
    """Turn a GPT decoder block spec (built with ``attention_output_gate`` and ``qk_layernorm``) into the
    hybrid one, in place: every layer's ``self_attention`` becomes a :class:`HybridMixer` of the gated
    attention and :class:`PackedGatedDeltaNet`; on the local spec every norm slot becomes
    :class:`ZeroCenteredRMSNorm` and the core attention takes packed sequences. Returns the layer count."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    if te:
        from megatron.core.extensions.transformer_engine import (
            TELayerNormColumnParallelLinear as InProj,
        )
        from megatron.core.extensions.transformer_engine import TERowParallelLinear as OutProj
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear as InProj
        from megatron.core.tensor_parallel.layers import RowParallelLinear as OutProj

        from gspo_megatron.models.packed_attention import use_packed_local_attention

        use_packed_local_attention(block_spec)
    gdn = ModuleSpec(
        module=gated_delta_net_class(),
        submodules=GatedDeltaNetSubmodules(in_proj=InProj, out_norm=PlainRMSNorm, out_proj=OutProj),
    )
    n = 0
    for layer in block_spec.layer_specs:
        sub = layer.submodules
        attn = sub.self_attention
        if not te:
            attn.submodules.q_layernorm = ZeroCenteredRMSNorm
            attn.submodules.k_layernorm = ZeroCenteredRMSNorm
            sub.input_layernorm = ZeroCenteredRMSNorm
            sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        sub.self_attention = ModuleSpec(module=HybridMixer, submodules=HybridMixerSubmodules(full=attn, linear=gdn))
        n += 1
    if not te:
        block_spec.layer_norm = ZeroCenteredRMSNorm
    return n


def mtp_layer_spec(layer_spec, te: bool):
    """The MTP layer spec (megatron's ``MultiTokenPredictionLayer``, its ``transformer_layer`` the last hybrid
    decoder layer's spec) as Qwen3-Next's MTP layer is built (sglang 0.5.23 ``srt/models/qwen3_next_mtp.py``:
    one decoder layer with ``full_attention_interval = 1``): its token mixer the gated full attention, not a
    :class:`HybridMixer` (which would pick by the MTP layer's number, past the pattern); on the local spec
    ``enorm``, ``hnorm`` and the final norm :class:`ZeroCenteredRMSNorm` (sglang's ``GemmaRMSNorm``; TE's
    norms honor ``layernorm_zero_centered_gamma``). A new spec; ``layer_spec`` is not changed."""
    from dataclasses import replace

    sub = layer_spec.submodules
    layer = sub.transformer_layer
    mixer = layer.submodules.self_attention
    while mixer.module is HybridMixer:  # nested where the decoder's layers share one submodules object
        mixer = mixer.submodules.full
    layer = replace(layer, submodules=replace(layer.submodules, self_attention=mixer))
    norms = {} if te else dict(enorm=ZeroCenteredRMSNorm, hnorm=ZeroCenteredRMSNorm, layer_norm=ZeroCenteredRMSNorm)
    return replace(layer_spec, submodules=replace(sub, transformer_layer=layer, **norms))
