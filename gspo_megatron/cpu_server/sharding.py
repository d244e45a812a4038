"""Which slice of an HF-named tensor SGLang 0.5.23's model runner puts on each engine TP rank.

Read from sglang's ``layers/linear.py`` (``ColumnParallelLinear``, ``QKVParallelLinear``,
``RowParallelLinear``), ``layers/vocab_parallel_embedding.py`` and
``layers/moe/fused_moe_triton/layer.py`` + ``distributed/parallel_state.py`` (MoE groups):

- column parallel (``q_proj``, ``k_proj``, ``v_proj``, dense ``gate_proj`` / ``up_proj``, their
  biases): dim 0 cut in ``tp`` equal parts, part ``tp_rank``. K/V with ``tp >= num_kv_heads``: each
  rank holds one KV head, head ``tp_rank // (tp // num_kv_heads)`` (replicated over
  ``tp // num_kv_heads`` ranks); ``num_heads % tp`` and ``num_kv_heads % tp`` (or
  ``tp % num_kv_heads``) must be 0 (sglang's ``divide`` asserts it).
- row parallel (``o_proj``, dense ``down_proj``): dim 1 cut in ``tp`` parts.
- vocab parallel (``embed_tokens``, ``lm_head``): the vocabulary is padded to a multiple of 64
  (``pad_vocab_size``), each rank owns ``padded / tp`` rows; rows past the real vocabulary are 0.
  A tied ``lm_head`` is the embedding (``lm_head.weight`` is skipped on load, as sglang does).
- MoE experts (``{block}.experts.{e}.{gate|up|down}``, named by the family's ``expert_naming``:
  ``models.registry.expert_weight``): ``moe_tp = tp / ep``; rank r has
  ``moe_tp_rank = r % moe_tp`` and ``moe_ep_rank = r // moe_tp``; it holds experts
  ``[moe_ep_rank * E/ep, (moe_ep_rank + 1) * E/ep)`` and of each the intermediate slice
  ``moe_tp_rank`` (gate / up: dim 0, down: dim 1). Other experts are not on the rank (None).
- experts stacked per layer (the family's ``stacked_expert_naming``, ``models.registry.stacked_expert_naming``;
  gpt-oss: ``mlp.experts.gate_up_proj`` [E, H, 2I] with gate / up interleaved, ``gate_up_proj_bias``
  [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]):
  sglang's ``models/gpt_oss.py`` ``_load_normal_weights`` transposes the weights and
  ``FusedMoE._load_w13`` / ``_load_w2`` cut the intermediate dimension in ``moe_tp`` contiguous parts
  (2I of gate_up as it is, interleaved, so each part keeps whole gate / up pairs): rank r holds the
  rows of its EP rank's experts and part ``moe_tp_rank`` of the intermediate dimension
  (``StackedExpertNaming.intermediate_dim``: 2 of gate_up, 1 of its bias and of down);
  ``down_proj_bias`` (no intermediate dimension) is held whole by MoE TP rank 0 and zero elsewhere
  (sglang zeroes it on the other ranks, so the reduced sum adds it once).
- attention sinks (gpt-oss ``self_attn.sinks``, one per head): cut by head like ``q_proj``.
- a row-parallel layer's bias (gpt-oss ``o_proj.bias``): whole on every rank (``RowParallelLinear``
  adds it on TP rank 0 after the reduction).
- everything else (norms, ``q_norm`` / ``k_norm``, the router ``gate``): replicated.

Full tensors have the HF checkpoint shape; a shard has the shape the rank stores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from gspo_megatron.models.hf_config import SPELLINGS
from gspo_megatron.models.registry import expert_weight, stacked_expert_naming

VOCAB_PADDING = 64  # sglang DEFAULT_VOCAB_PADDING_SIZE

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Layout:
    """The engine's parallel sizes and the model dimensions sharding needs."""

    tp_size: int
    ep_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int
    model_type: str | None = None

    @classmethod
    def from_config(cls, hf_config: Any, tp_size: int, ep_size: int = 1) -> "Layout":
        """``hf_config``: a dict with the text fields at the top level (``models.hf_config.load_hf_config``)
        or a ``PretrainedConfig`` (of a vision-language checkpoint, its ``get_text_config()``)."""
        if not isinstance(hf_config, Mapping) and hasattr(hf_config, "get_text_config"):
            hf_config = hf_config.get_text_config()
        get = (
            (lambda k, d=None: hf_config.get(k, d))
            if isinstance(hf_config, Mapping)
            else (lambda k, d=None: getattr(hf_config, k, d))
        )
        heads = int(get("num_attention_heads"))
        head_dim = get("head_dim") or int(get("hidden_size")) // heads
        # every spelling the trainer reads (models/hf_config.py SPELLINGS: DeepSeek / GLM's n_routed_experts too)
        experts = next((get(k) for k in SPELLINGS["num_experts"] if get(k)), 0)
        return cls(
            int(tp_size),
            int(ep_size),
            heads,
            int(get("num_key_value_heads") or heads),
            int(head_dim),
            int(get("vocab_size")),
            int(experts),
            get("model_type"),
        )

    def check(self) -> None:
        """Refuse what sglang's ``divide`` asserts would refuse (one clear line)."""
        tp, ep = self.tp_size, self.ep_size
        if tp < 1 or ep < 1 or tp % ep:
            raise ValueError(f"--ep-size {ep} must divide --tp-size {tp}")
        if self.num_heads % tp:
            raise ValueError(f"num_attention_heads {self.num_heads} is not divisible by --tp-size {tp}")
        kv = self.num_kv_heads
        if (tp >= kv and tp % kv) or (tp < kv and kv % tp):
            raise ValueError(f"num_key_value_heads {kv} and --tp-size {tp}: one must divide the other")
        if self.num_experts and self.num_experts % ep:
            raise ValueError(f"num_experts {self.num_experts} is not divisible by --ep-size {ep}")

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    def padded_vocab(self) -> int:
        return -(-self.vocab_size // VOCAB_PADDING) * VOCAB_PADDING


def kind_of(name: str) -> str:
    """``"expert" | "stacked" | "column" | "kv" | "row" | "vocab" | "replicated"`` for an HF weight name."""
    if expert_weight(name) is not None:
        return "expert"
    if stacked_expert_naming(name) is not None:
        return "stacked"
    if name.endswith("self_attn.sinks"):
        return "column"
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return "vocab"
    parts = name.split(".")
    proj = parts[-2] if len(parts) >= 2 else ""
    if proj in ("k_proj", "v_proj"):
        return "kv"
    if proj in _COLUMN:
        return "column"
    if proj in _ROW:
        return "replicated" if name.endswith(".bias") else "row"
    return "replicated"


def expert_of(name: str) -> tuple[int, str]:
    """(expert id, ``"gate" | "up" | "down"``) of an expert weight name (``kind_of`` "expert"): the
    family's naming (``models.registry.expert_weight``). Raises ValueError for any other name."""
    found = expert_weight(name)
    if found is None:
        raise ValueError(f"{name} is not a routed expert's weight of any family")
    return found


def _stacked_dim(name: str) -> int | None:
    """The intermediate dimension of a stacked expert tensor (``kind_of`` "stacked"), None for one
    without (gpt-oss's ``down_proj_bias``): the family's ``StackedExpertNaming.intermediate_dim``."""
    naming = stacked_expert_naming(name)
    if naming is None:
        raise ValueError(f"{name} is not a stacked expert tensor of any family")
    return naming.intermediate_dim(name)


def _chunk(t: torch.Tensor, dim: int, parts: int, idx: int) -> torch.Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"dim {dim} of size {t.shape[dim]} is not divisible by {parts}")
    size = t.shape[dim] // parts
    return t.narrow(dim, idx * size, size)


def shard_for_rank(name: str, full: torch.Tensor, tp_rank: int, layout: Layout) -> torch.Tensor | None:
    """What ``tp_rank`` stores of HF tensor ``name`` (a new contiguous tensor), or None when the
    tensor has no part on that rank (an expert of another EP rank)."""
    tp = layout.tp_size
    kind = kind_of(name)
    if kind == "replicated" or tp == 1 and kind != "expert" and kind != "vocab":
        return full.clone()
    if kind == "column":
        return _chunk(full, 0, tp, tp_rank).clone()
    if kind == "row":
        return _chunk(full, 1, tp, tp_rank).clone()
    if kind == "kv":
        kv = layout.num_kv_heads
        if tp >= kv:
            head = tp_rank // (tp // kv)
            return _chunk(full, 0, kv, head).clone()
        return _chunk(full, 0, tp, tp_rank).clone()
    if kind == "stacked":
        return _stacked_shard(name, full, tp_rank, layout)
    if kind == "vocab":
        per = layout.padded_vocab() // tp
        out = full.new_zeros((per, *full.shape[1:]))
        start = tp_rank * per
        end = min(start + per, full.shape[0])
        if end > start:
            out[: end - start] = full[start:end]
        return out
    expert, role = expert_of(name)
    moe_tp = layout.moe_tp_size
    ep_rank, moe_tp_rank = tp_rank // moe_tp, tp_rank % moe_tp
    per_ep = layout.num_experts // layout.ep_size
    if not ep_rank * per_ep <= expert < (ep_rank + 1) * per_ep:
        return None
    dim = 1 if role == "down" else 0
    return _chunk(full, dim, moe_tp, moe_tp_rank).clone()


def _stacked_shard(name: str, full: torch.Tensor, tp_rank: int, layout: Layout) -> torch.Tensor:
    dim = _stacked_dim(name)
    moe_tp = layout.moe_tp_size
    ep_rank, moe_tp_rank = tp_rank // moe_tp, tp_rank % moe_tp
    per_ep = layout.num_experts // layout.ep_size
    rows = full.narrow(0, ep_rank * per_ep, per_ep)
    if dim is None:
        return rows.clone() if moe_tp_rank == 0 else torch.zeros_like(rows)
    return _chunk(rows, dim, moe_tp, moe_tp_rank).clone()


def owner_ranks(name: str, layout: Layout) -> list[int]:
    """The TP ranks whose shards together make the full tensor, in order (one per distinct part)."""
    tp = layout.tp_size
    kind = kind_of(name)
    if kind == "replicated" or (tp == 1 and kind != "expert"):
        return [0]
    if kind == "kv" and tp >= layout.num_kv_heads:
        return list(range(0, tp, tp // layout.num_kv_heads))
    if kind == "expert":
        expert, _ = expert_of(name)
        ep_rank = expert // (layout.num_experts // layout.ep_size)
        return [ep_rank * layout.moe_tp_size + i for i in range(layout.moe_tp_size)]
    if kind == "stacked" and _stacked_dim(name) is None:  # whole on MoE TP rank 0 of each EP rank
        return list(range(0, tp, layout.moe_tp_size))
    return list(range(tp))


def assemble(name: str, shards: Sequence[torch.Tensor], layout: Layout, full_shape: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`shard_for_rank`: the full tensor from the shards of ``owner_ranks(name)``."""
    kind = kind_of(name)
    if len(shards) == 1 and kind != "vocab":
        return shards[0]
    if kind == "vocab":
        return torch.cat(list(shards), 0)[: full_shape[0]]
    if kind == "stacked":  # experts of each EP rank: its moe_tp parts side by side; EP ranks stacked
        dim = _stacked_dim(name)
        if dim is None:
            return torch.cat(list(shards), 0)
        k = layout.moe_tp_size
        return torch.cat([torch.cat(list(shards[i : i + k]), dim) for i in range(0, len(shards), k)], 0)
    if kind == "row" or (kind == "expert" and expert_of(name)[1] == "down"):
        return torch.cat(list(shards), 1)
    return torch.cat(list(shards), 0)


def expected_shard(
    name: str, full_tensor: torch.Tensor, tp_rank: int, tp_size: int, ep_size: int, hf_config: Any
) -> torch.Tensor | None:
    """What SGLang's sharding puts on engine TP rank ``tp_rank`` of HF tensor ``name`` (full
    checkpoint shape), or None when the rank holds no part of it (an expert of another EP rank).
    ``hf_config``: the model's config (object or dict). Tests compare this with the server's shards."""
    layout = Layout.from_config(hf_config, tp_size, ep_size)
    return shard_for_rank(name, full_tensor, tp_rank, layout)
