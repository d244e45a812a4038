"""Declarative Megatron <-> Hugging Face weight mappings (in the style of Megatron-Bridge).

A family lists rules; each rule pairs a Megatron parameter pattern with one or more HF checkpoint
patterns. ``*`` matches an index: the first ``*`` is the (global) layer, the second the (global)
expert. A rule knows how the parameter is sharded over tensor parallel ranks, so it can

- ``to_local``: build one rank's shard from the full HF tensors (checkpoint load, HF -> Megatron);
- ``from_shards``: rebuild the full HF tensors from all ranks' shards (export, weight sync).

Names handled here are *global* Megatron names (layer and expert indices over the whole model);
``weights.py`` translates the local names a pipeline stage / expert-parallel rank sees.
The same rules serve checkpoint conversion, HF export and weight sync.

A rule serves both Megatron layer specs (local and Transformer Engine) unless it names one
(``spec="local"`` / ``spec="te"``): where the two specs shard a parameter of the same name
differently (multi-latent attention's down projections: split over TP on the local spec, whole on
every TP rank on TE's, ``TELinear`` ``parallel_mode="duplicated"``), the family lists one rule per
spec and ``MappingRegistry.for_model`` keeps those of the spec the model was built on.

A family also declares its *fuse groups* (``FuseGroup``): HF tensors that a rollout engine's loader
combines into one parameter only when every part arrives in the same ``load_weights`` call (sglang's
DeepSeek loader concatenates ``q_a_proj`` and ``kv_a_proj_with_mqa`` into
``fused_qkv_a_proj_with_mqa`` and silently drops a lone half). The export stream keeps each group in
one bucket (``weights.py``). Parts that the engine loads one shard at a time into a stacked parameter
(sglang's ``stacked_params_mapping``: q/k/v, gate/up, experts) need no group.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Sequence

import torch


def _pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$")


def _fill(pattern: str, indices: Sequence[str]) -> str:
    out = pattern
    for idx in indices:
        out = out.replace("*", idx, 1)
    return out


@dataclass(frozen=True)
class AttentionDims:
    """Head geometry needed to (de)interleave the fused QKV projection."""

    num_heads: int
    num_query_groups: int
    head_dim: int


SPECS = ("local", "te")  # Megatron's local layer spec, Transformer Engine's


class Rule:
    """Base rule. ``parallel`` is "tp" (dense tensor parallel group), "etp" (expert tensor parallel
    group) or None (replicated). ``spec``: None (both layer specs) or the one of ``SPECS`` it is for."""

    split_dim: int | None = None

    def __init__(
        self,
        megatron: str,
        hf: str | Sequence[str],
        parallel: str | None = None,
        export: bool = True,
        spec: str | None = None,
    ):
        if spec is not None and spec not in SPECS:
            raise ValueError(f"rule {megatron!r}: spec must be one of {SPECS} or None, got {spec!r}")
        self.megatron = megatron
        self.hf = (hf,) if isinstance(hf, str) else tuple(hf)
        self.parallel = parallel
        self.export = export  # False: loaded from HF but not exported (e.g. tied lm_head copy)
        self.spec = spec
        self._regex = _pattern_regex(megatron)

    def match(self, megatron_name: str) -> tuple[str, ...] | None:
        m = self._regex.match(megatron_name)
        return None if m is None else m.groups()

    #: added to the layer index (the first ``*``) in the HF names: the MTP layer's rules map megatron's
    #: ``mtp.layers.{k}`` to HF ``model.layers.{N + k}`` (``models/mtp.py``)
    hf_layer_offset = 0

    def moved(self, megatron: str, hf_layer_offset: int, hf: Sequence[str] | None = None) -> Rule:
        """This rule (same sharding) for the Megatron pattern ``megatron``, its HF layer index shifted by
        ``hf_layer_offset``, its HF patterns ``hf`` (default: the same) (the MTP layer's copy of a
        decoder-layer rule)."""
        out = copy.copy(self)
        out.megatron, out._regex, out.hf_layer_offset = megatron, _pattern_regex(megatron), hf_layer_offset
        if hf is not None:
            if len(hf) != len(self.hf):
                raise ValueError(f"rule {megatron!r}: {len(hf)} HF patterns for {len(self.hf)}")
            out.hf = tuple(hf)
        return out

    def hf_names(self, indices: Sequence[str]) -> tuple[str, ...]:
        if self.hf_layer_offset and indices:
            indices = (str(int(indices[0]) + self.hf_layer_offset), *indices[1:])
        return tuple(_fill(p, indices) for p in self.hf)

    #: True when the HF tensors hold every expert of a layer stacked along dim 0 (gpt-oss's fused
    #: ``mlp.experts.gate_up_proj`` [E, ...]); the rule then maps one expert's slice.
    stacked_experts = False

    def expert_index(self, megatron_name: str) -> int | None:
        """The expert whose slice of the stacked HF tensors ``megatron_name`` maps (None when the HF
        tensors are not stacked). The second ``*`` of the pattern is the global expert index."""
        if not self.stacked_experts:
            return None
        indices = self.match(megatron_name)
        if indices is None:
            raise ValueError(f"{megatron_name} does not match the rule {self.megatron!r}")
        return int(indices[1])

    # -- overridden per sharding kind ------------------------------------------------------------
    def to_local(self, hf: Sequence[torch.Tensor], rank: int, size: int) -> torch.Tensor:
        (t,) = hf
        if self.split_dim is None or size == 1:
            return t
        return _chunk(t, self.split_dim, rank, size)

    def from_shards(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if self.split_dim is None or len(shards) == 1:
            return [shards[0]]
        return [torch.cat(list(shards), dim=self.split_dim)]

    def load_into(self, param: torch.Tensor, hf: Sequence[torch.Tensor], rank: int, size: int, copy=None) -> None:
        """``param.copy_(self.to_local(hf, rank, size))`` without building the shard first where the
        rule allows it: each HF piece (a view of the memory-mapped file) is copied straight into its
        place in ``param`` (one copy instead of two or three: the conversion's hot loop). Exactly the
        values ``to_local`` gives. Raises ValueError when the shapes do not fit. ``copy(dst, src)``
        does each copy (default ``dst.copy_(src)``; the safetensors reader's reads from the file)."""
        pieces = self._pieces(param, hf, rank, size)
        if pieces is None:
            pieces = [(param, self.to_local(hf, rank, size))]
        for dst, src in pieces:
            if tuple(dst.shape) != tuple(src.shape):
                raise ValueError(f"shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
        for dst, src in pieces:
            if copy is None:
                dst.copy_(src)
            else:
                copy(dst, src)

    def _pieces(self, param, hf, rank, size):
        """[(view of param, view of an HF tensor)] covering ``param``, or None (use ``to_local``)."""
        if type(self).to_local is not Rule.to_local or len(hf) != 1:
            return None
        (t,) = hf
        if self.split_dim is None or size == 1:
            return [(param, t)]
        if t.dim() <= self.split_dim or t.shape[self.split_dim] % size:
            return None
        return [(param, t.chunk(size, dim=self.split_dim)[rank])]


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split over {size} ranks")
    return t.chunk(size, dim=dim)[rank].contiguous()


class Replicated(Rule):
    """The same tensor on every rank (norms, router)."""


class ColumnParallel(Rule):
    """Output dimension (dim 0) split over ranks: column-parallel linears, vocab-parallel embedding."""

    split_dim = 0


class RowParallel(Rule):
    """Input dimension (dim 1) split over ranks: row-parallel linears (attention out, fc2)."""

    split_dim = 1


class PermutedRows(ColumnParallel):
    """A column-parallel weight whose HF rows are permuted into Megatron's order (``perm``: the HF row
    index of each Megatron row, over the full tensor) before the TP split; the export inverts it.
    Used for the rope rows of DeepSeek checkpoints with ``rope_interleave=false`` (Megatron's MLA
    expects interleaved rope rows): the same dot products, exactly. ``parallel=None``: the whole
    permuted tensor on every rank (TE's duplicated ``linear_kv_down_proj``)."""

    def __init__(self, megatron, hf, perm: torch.Tensor, parallel: str | None = "tp", spec: str | None = None):
        super().__init__(megatron, hf, parallel, spec=spec)
        self.perm = perm
        self.inverse = torch.argsort(perm)

    def to_local(self, hf, rank, size):
        (t,) = hf
        return super().to_local([t[self.perm]], rank, size)

    def from_shards(self, shards):
        (full,) = super().from_shards(shards)
        if full.device.type == "meta":
            return [full]
        return [full[self.inverse.to(full.device)].contiguous()]


class GatedFC1(Rule):
    """Megatron's fused [gate; up] fc1. Each rank holds [gate_r; up_r] (its slice of each half)."""

    split_dim = 0

    def to_local(self, hf, rank, size):
        gate, up = hf
        return torch.cat([_chunk(gate, 0, rank, size), _chunk(up, 0, rank, size)], dim=0)

    def from_shards(self, shards):
        halves = [s.chunk(2, dim=0) for s in shards]
        if len(halves) == 1:  # the two halves as views, as the base rule returns a single shard itself
            return list(halves[0])
        return [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]

    def _pieces(self, param, hf, rank, size):
        if type(self).to_local is not GatedFC1.to_local or len(hf) != 2 or param.shape[0] % 2:
            return None
        if any(t.dim() == 0 or t.shape[0] % size for t in hf):
            return None
        return [(half, t.chunk(size, dim=0)[rank]) for half, t in zip(param.chunk(2, dim=0), hf)]


class FusedQKV(Rule):
    """Megatron's fused QKV (weight or bias): rows grouped per query group as
    [q heads of the group, k, v]; tensor parallel splits whole groups over ranks."""

    split_dim = 0

    def __init__(self, megatron, hf, dims: AttentionDims, parallel="tp"):
        super().__init__(megatron, hf, parallel)
        self.dims = dims

    def _full(self, q, k, v):
        d = self.dims
        g, per = d.num_query_groups, d.num_heads // d.num_query_groups
        rest = q.shape[1:]
        q = q.reshape(g, per * d.head_dim, *rest)
        k = k.reshape(g, d.head_dim, *rest)
        v = v.reshape(g, d.head_dim, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def to_local(self, hf, rank, size):
        full = self._full(*hf)
        return _chunk(full, 0, rank, size) if size > 1 else full

    def _pieces(self, param, hf, rank, size):
        d = self.dims
        g, per, hd = d.num_query_groups, d.num_heads // d.num_query_groups, d.head_dim
        if len(hf) != 3 or g % size or param.dim() == 0:
            return None
        q, k, v = hf
        rest = tuple(param.shape[1:])
        if (
            tuple(q.shape) != (g * per * hd, *rest)
            or tuple(k.shape) != (g * hd, *rest)
            or tuple(v.shape) != (g * hd, *rest)
            or param.shape[0] != g // size * (per + 2) * hd
        ):
            return None
        lo, hi = rank * (g // size), (rank + 1) * (g // size)  # this rank's query groups
        mine = param.view(g // size, (per + 2) * hd, *rest)
        return [
            (mine[:, : per * hd], q.reshape(g, per * hd, *rest)[lo:hi]),
            (mine[:, per * hd : (per + 1) * hd], k.reshape(g, hd, *rest)[lo:hi]),
            (mine[:, (per + 1) * hd :], v.reshape(g, hd, *rest)[lo:hi]),
        ]

    def from_shards(self, shards):
        d = self.dims
        full = torch.cat(list(shards), 0) if len(shards) > 1 else shards[0]
        per = d.num_heads // d.num_query_groups
        rest = full.shape[1:]
        grouped = full.reshape(d.num_query_groups, (per + 2) * d.head_dim, *rest)
        q, k, v = torch.split(grouped, [per * d.head_dim, d.head_dim, d.head_dim], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


class StackedExpertFC1(GatedFC1):
    """Megatron's per-expert fused [gate; up] fc1 (weight [2I, H] or bias [2I]) from one expert's
    slice of a stacked HF tensor whose gate and up are *interleaved* along the last dim (gpt-oss:
    ``gate_up_proj`` [E, H, 2I] stored input-major, ``gate_up_proj_bias`` [E, 2I]; gate = [..., 0::2],
    up = [..., 1::2]). ``transposed``: the slice is [in, out] (weights), not [out] (biases). Exact copies
    both ways."""

    stacked_experts = True

    def __init__(self, megatron, hf, parallel="etp", transposed: bool = True):
        super().__init__(megatron, hf, parallel)
        self.transposed = transposed

    def to_local(self, hf, rank, size):
        (t,) = hf
        gate, up = t[..., 0::2], t[..., 1::2]
        if self.transposed:
            gate, up = gate.t(), up.t()
        return super().to_local([gate, up], rank, size)

    def from_shards(self, shards):
        gate, up = super().from_shards(shards)
        if self.transposed:
            gate, up = gate.t(), up.t()
        return [torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1]).contiguous()]


class StackedExpertFC2(RowParallel):
    """A per-expert fc2 weight [H, I] (row parallel) from one expert's slice [I, H] of a stacked HF
    tensor stored input-major (gpt-oss ``down_proj`` [E, I, H])."""

    stacked_experts = True

    def to_local(self, hf, rank, size):
        (t,) = hf
        return super().to_local([t.t()], rank, size)

    def from_shards(self, shards):
        (full,) = super().from_shards(shards)
        return [full.t().contiguous()]


class StackedExpertReplicated(Replicated):
    """A per-expert tensor kept whole on every expert-tensor-parallel rank (gpt-oss ``down_proj_bias``
    [E, H]: the fc2 bias, added once after the row-parallel reduction)."""

    stacked_experts = True


@dataclass(frozen=True)
class FuseGroup:
    """HF tensor patterns (``*`` = the layer, as in the rules) that the rollout engine must receive
    in one ``load_weights`` call; ``why`` names the engine code that fuses them."""

    hf: tuple[str, ...]
    why: str = ""

    def __post_init__(self):
        if len(self.hf) < 2:
            raise ValueError(f"a fuse group needs at least two HF names, got {self.hf}")


class MappingRegistry:
    """An ordered list of rules for one model family; first match wins. ``fuse_groups``: the
    family's ``FuseGroup``s (see the module docstring)."""

    def __init__(self, rules: Sequence[Rule], fuse_groups: Sequence[FuseGroup] = ()):
        self.rules = list(rules)
        self.fuse_groups = list(fuse_groups)
        self._fuse = [[_pattern_regex(p) for p in g.hf] for g in self.fuse_groups]

    def for_spec(self, te: bool) -> MappingRegistry:
        """The rules of one layer spec (``te``: Transformer Engine's, else the local one): those for
        both specs and those naming this one, in their order; the same fuse groups."""
        spec = "te" if te else "local"
        return MappingRegistry([r for r in self.rules if r.spec in (None, spec)], self.fuse_groups)

    def for_model(self, model) -> MappingRegistry:
        """``for_spec`` of the spec ``model`` (one GPTModel chunk) was built on."""
        return self.for_spec(uses_transformer_engine(model))

    def fuse_key(self, hf_names: Sequence[str]) -> tuple | None:
        """A hashable key shared by every HF tensor of one fuse group instance (group index and the
        ``*`` values, e.g. the layer), or None when none of ``hf_names`` belongs to a group."""
        for name in hf_names:
            for i, regexes in enumerate(self._fuse):
                for r in regexes:
                    m = r.match(name)
                    if m is not None:
                        return (i, *m.groups())
        return None

    def find(self, megatron_name: str) -> tuple[Rule, tuple[str, ...]] | None:
        """The rule for a global Megatron name and the HF names it maps to; None when no rule matches.
        On a registry not narrowed by ``for_spec`` a name with one rule per spec finds the first
        listed (the local spec's)."""
        for rule in self.rules:
            idx = rule.match(megatron_name)
            if idx is not None:
                return rule, rule.hf_names(idx)
        return None

    def resolve(self, megatron_name: str) -> tuple[Rule, tuple[str, ...]]:
        """Like ``find``; raises KeyError naming a parameter that no rule maps."""
        found = self.find(megatron_name)
        if found is None:
            raise KeyError(f"no weight mapping for Megatron parameter {megatron_name!r}")
        return found


# Where Megatron-Core 0.16.1 defines its Transformer Engine modules (TELinear, TENorm's products are
# TE's own norms): a model holding one of them was built on TE's layer spec.
_TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine.")


def uses_transformer_engine(model) -> bool:
    """True when ``model`` was built on Transformer Engine's layer spec (one of its modules is a
    class of ``megatron/core/extensions/transformer_engine.py`` or of TE itself)."""
    return any(type(m).__module__.startswith(_TE_MODULES) for m in model.modules())
