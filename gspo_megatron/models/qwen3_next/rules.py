"""Weight-mapping rules of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5-MoE).

Gated DeltaNet (HF ``linear_attn``; Hk key heads of dk, Hv value heads of dv, r = Hv / Hk):
- Qwen3-Next packs the input projection per key head: ``in_proj_qkvz`` rows, for each key head h,
  [q_h (dk) | k_h (dk) | v of its r value heads (r*dv) | z of them (r*dv)], and ``in_proj_ba`` rows
  [b of its r value heads | a of them] per key head;
- Qwen3.5 keeps the parts apart: ``in_proj_qkv`` [q (Hk*dk) | k (Hk*dk) | v (Hv*dv)], ``in_proj_z``
  [Hv*dv], ``in_proj_b`` [Hv], ``in_proj_a`` [Hv].
Megatron's ``in_proj`` on TP rank p holds [q_p | k_p | v_p | z_p | beta_p | alpha_p], each part the
rows of this rank's heads (key heads [p*Hk/tp, (p+1)*Hk/tp), value heads likewise): ``GDNInProj``.
``conv1d.weight`` [2*Hk*dk + Hv*dv, 1, K] has channels [q | k | v] in both checkpoints; Megatron's rank p
holds [q_p | k_p | v_p]: ``GDNConv``. Every rule is a permutation of rows: exact both ways.

Gated full attention: HF ``q_proj`` rows per head [query (d) | gate (d)]; Megatron's fused
``linear_qkv`` with ``attention_output_gate`` has rows per query group [queries of the group | their
gates | k | v] (``attention.py:get_query_key_value_tensors``): ``GatedFusedQKV``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo_megatron.models.mapping import FusedQKV, Rule, _chunk


@dataclass(frozen=True)
class GDNDims:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    @property
    def r(self) -> int:
        return self.value_heads // self.key_heads

    def sizes(self, tp: int = 1) -> list[int]:
        """Row counts of [q, k, v, z, beta, alpha] on one of ``tp`` ranks."""
        qk, v, h = self.key_heads * self.key_dim // tp, self.value_heads * self.value_dim // tp, self.value_heads // tp
        return [qk, qk, v, v, h, h]


class GDNInProj(Rule):
    """Megatron ``in_proj.weight`` <- HF (``in_proj_qkvz``, ``in_proj_ba``) (``packed=True``, Qwen3-Next) or
    (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) (Qwen3.5); see the module docstring."""

    split_dim = 0

    def __init__(self, megatron, hf, dims: GDNDims, packed: bool, parallel="tp"):
        super().__init__(megatron, hf, parallel)
        self.dims, self.packed = dims, packed

    def _parts(self, hf) -> list[torch.Tensor]:
        """Full [q, k, v, z, b, a], each [heads, rows per head, *rest] (head-major)."""
        d = self.dims
        if self.packed:
            qkvz, ba = hf
            rest = qkvz.shape[1:]
            per = qkvz.reshape(d.key_heads, -1, *rest)
            q, k, v, z = torch.split(per, [d.key_dim, d.key_dim, d.r * d.value_dim, d.r * d.value_dim], dim=1)
            b, a = torch.split(ba.reshape(d.key_heads, 2 * d.r, *rest), [d.r, d.r], dim=1)
            v, z = (t.reshape(d.value_heads, d.value_dim, *rest) for t in (v, z))
            b, a = (t.reshape(d.value_heads, 1, *rest) for t in (b, a))
            return [q, k, v, z, b, a]
        qkv, z, b, a = hf
        rest = qkv.shape[1:]
        q, k, v = torch.split(qkv, [d.key_heads * d.key_dim] * 2 + [d.value_heads * d.value_dim], dim=0)
        return [
            q.reshape(d.key_heads, d.key_dim, *rest),
            k.reshape(d.key_heads, d.key_dim, *rest),
            v.reshape(d.value_heads, d.value_dim, *rest),
            z.reshape(d.value_heads, d.value_dim, *rest),
            b.reshape(d.value_heads, 1, *rest),
            a.reshape(d.value_heads, 1, *rest),
        ]

    def to_local(self, hf, rank, size):
        parts = self._parts(hf)
        rest = parts[0].shape[2:]
        return torch.cat([_chunk(t, 0, rank, size).reshape(-1, *rest) for t in parts], dim=0)

    def from_shards(self, shards):
        d = self.dims
        tp = len(shards)
        split = [torch.split(s, d.sizes(tp), dim=0) for s in shards]
        q, k, v, z, b, a = (torch.cat([s[i] for s in split], dim=0) for i in range(6))
        rest = q.shape[1:]
        if not self.packed:
            return [torch.cat([q, k, v], dim=0).contiguous(), z.contiguous(), b.contiguous(), a.contiguous()]
        kh = d.key_heads
        qkvz = torch.cat(
            [q.reshape(kh, -1, *rest), k.reshape(kh, -1, *rest), v.reshape(kh, -1, *rest), z.reshape(kh, -1, *rest)],
            dim=1,
        ).reshape(-1, *rest)
        ba = torch.cat([b.reshape(kh, -1, *rest), a.reshape(kh, -1, *rest)], dim=1).reshape(-1, *rest)
        return [qkvz.contiguous(), ba.contiguous()]


class GDNConv(Rule):
    """Megatron ``conv1d.weight`` (or bias) <- HF ``conv1d.weight``: channels [q | k | v], split per part."""

    split_dim = 0

    def __init__(self, megatron, hf, dims: GDNDims, parallel="tp"):
        super().__init__(megatron, hf, parallel)
        self.dims = dims

    def _sizes(self, tp: int) -> list[int]:
        return self.dims.sizes(tp)[:3]

    def to_local(self, hf, rank, size):
        (t,) = hf
        return torch.cat([_chunk(p, 0, rank, size) for p in torch.split(t, self._sizes(1), dim=0)], dim=0)

    def from_shards(self, shards):
        split = [torch.split(s, self._sizes(len(shards)), dim=0) for s in shards]
        return [torch.cat([torch.cat([s[i] for s in split], dim=0) for i in range(3)], dim=0).contiguous()]


class GatedFusedQKV(FusedQKV):
    """Megatron's ``linear_qkv`` with an output gate <- HF (``q_proj`` [H*2d: per head query | gate],
    ``k_proj``, ``v_proj``); Megatron rows per query group: [queries | gates | k | v]."""

    def _full(self, q, k, v):
        d = self.dims
        g, per, hd = d.num_query_groups, d.num_heads // d.num_query_groups, d.head_dim
        rest = q.shape[1:]
        qg = q.reshape(g, per, 2, hd, *rest)
        query, gate = qg[:, :, 0].reshape(g, per * hd, *rest), qg[:, :, 1].reshape(g, per * hd, *rest)
        return torch.cat([query, gate, k.reshape(g, hd, *rest), v.reshape(g, hd, *rest)], dim=1).reshape(-1, *rest)

    def _pieces(self, param, hf, rank, size):
        return None

    def from_shards(self, shards):
        d = self.dims
        g, per, hd = d.num_query_groups, d.num_heads // d.num_query_groups, d.head_dim
        full = torch.cat(list(shards), 0) if len(shards) > 1 else shards[0]
        rest = full.shape[1:]
        grouped = full.reshape(g, (2 * per + 2) * hd, *rest)
        query, gate, k, v = torch.split(grouped, [per * hd, per * hd, hd, hd], dim=1)
        q = torch.stack([query.reshape(g, per, hd, *rest), gate.reshape(g, per, hd, *rest)], dim=2)
        return [q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous()]
