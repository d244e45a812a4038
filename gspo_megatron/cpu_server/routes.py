"""The CPU server's routed experts: what each transformers MoE router chose in the server's own forward.

``RouteRecorder(model, perturb)`` hooks every top-k router of a transformers MoE model (the classes
its family lists in ``hf_router_classes``, e.g. ``Qwen3MoeTopKRouter``: ``forward(h [N, H]) ->
(logits [N, E], scores [N, K], indices [N, K])``) and keeps each forward's indices; ``take(batch,
seq)`` returns them as int64 [batch, seq, num_hidden_layers, K] (a layer without a router, i.e. a
dense layer, is 0, as sglang's zero-filled capture buffer leaves it). ``HFRolloutEngine`` cuts them
per request into sglang's ``[routed_experts_start_len, seqlen - 1)`` (see ``engines/routing.py``).

``perturb`` (server flag ``--router-logit-perturbation``, not sglang's): the engine chooses each
token's top-k experts from ``logits + perturb * (h @ P_l)`` with ``P_l`` [H, E] a fixed
standard-normal matrix per layer (seed 1234 + layer), i.e. a deterministic, token-dependent change of
the engine's routing decisions only, standing in for the routing flips of a bf16 / other-kernel
engine. The chosen experts' weights are the model's own: softmax of the unperturbed logits in fp32
gathered at the chosen ids, renormalized when ``norm_topk_prob`` (Mixtral always), which is what
Megatron's router computes when it replays those ids (``trainer/route_replay.py``); attention,
experts and the LM head are untouched. So a trainer replaying the engine's routes (R3) computes the
engine's function, and one routing by itself differs exactly where the choice flipped.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from gspo_megatron.models.registry import families

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# the registered families' transformers router classes (``ModelFamily.hf_router_classes``)
ROUTER_CLASSES: tuple[str, ...] = tuple(dict.fromkeys(c for f in families() for c in f.hf_router_classes))
# sigmoid routers with bias and group-limited choice (``hf_router_perturbable = False``): recorded as they
# are, never perturbed (the perturbation's weights are the softmax routers')
_NO_PERTURB: tuple[str, ...] = tuple(
    dict.fromkeys(c for f in families() if not f.hf_router_perturbable for c in f.hf_router_classes)
)
# the DSA families' transformers indexer classes (``ModelFamily.hf_indexer_classes``)
INDEXER_CLASSES: tuple[str, ...] = tuple(dict.fromkeys(c for f in families() for c in f.hf_indexer_classes))
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: torch.nn.Module) -> list[tuple[int, Any]]:
    """(decoder layer index, router module) of every top-k router, in layer order (a module of one of
    ``ROUTER_CLASSES``, which differ in class but all have ``top_k``)."""
    out = []
    for name, m in model.named_modules():
        if type(m).__name__ in ROUTER_CLASSES:
            match = _LAYER_RE.search(name)
            if match is None:
                raise ValueError(f"router {name}: no decoder layer index in its name")
            out.append((int(match.group(1)), m))
    return sorted(out, key=lambda x: x[0])


class RouteRecorder:
    """Forward hooks on a model's routers that record (and, with ``perturb``, change) top-k ids."""

    def __init__(self, model: PreTrainedModel, perturb: float = 0.0):
        self.num_layers = int(model.config.num_hidden_layers)
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__}: no MoE router of {ROUTER_CLASSES} to return routed experts from")
        self.topk = int(self.routers[0][1].top_k)
        self.perturb = float(perturb)
        if self.perturb and type(self.routers[0][1]).__name__ in _NO_PERTURB:
            raise ValueError(
                f"--router-logit-perturbation: not implemented for {type(self.routers[0][1]).__name__} "
                "(sigmoid router with bias)"
            )
        self._seen: dict[int, torch.Tensor] = {}
        self._proj: dict[int, torch.Tensor] = {}
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in self.routers]

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self.perturb:
                output = self._perturbed(layer, module, args[0])
            self._seen[layer] = output[2].detach().to(torch.int64).cpu()
            return output

        return hook

    def _perturbed(self, layer: int, module, hidden: torch.Tensor):
        h = hidden.reshape(-1, module.weight.shape[1])
        if layer not in self._proj:
            g = torch.Generator(device="cpu").manual_seed(1234 + layer)
            self._proj[layer] = torch.randn(module.weight.shape[1], module.weight.shape[0], generator=g)
        logits = F.linear(h, module.weight)
        moved = logits + self.perturb * (h.float() @ self._proj[layer].to(h.device)).to(logits.dtype)
        idx = torch.topk(moved, module.top_k, dim=-1).indices  # the experts: chosen from the moved logits
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top = probs.gather(1, idx)  # their weights: the model's own, as a trainer replaying idx computes them
        if getattr(module, "norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The last forward's routes: int64 [batch, seq, num_hidden_layers, topk]; clears them."""
        out = torch.zeros(batch, seq, self.num_layers, self.topk, dtype=torch.int64)
        for layer, _ in self.routers:
            if layer not in self._seen:
                raise RuntimeError(f"router of layer {layer} did not run in the last forward")
            out[:, :, layer] = self._seen[layer].reshape(batch, seq, self.topk)
        self._seen.clear()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class IndexerRecorder:
    """Forward hooks on a DSA model's indexers (the classes its family lists in ``hf_indexer_classes``,
    transformers' ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer``: ``forward(...) -> int32 [B, S,
    min(index_topk, T)]``, indices into the key row of the forward, the KV cache's columns included)
    that keep each forward's selection.

    ``take(pads, positions)`` turns the last forward's indices into sequence positions: the engine's
    batches are left-padded, so cache column ``c`` of row ``i`` holds the token at position
    ``c - pads[i]``; a selected column counts when ``0 <= c - pads[i] <= positions[i, s]`` (the query's
    own position: transformers' mask sets everything else to -inf, which ``topk`` may still return on
    a row with fewer valid keys than ``index_topk``). Each query's keys come back sorted ascending,
    -1 after them (sglang returns a set, -1 where fewer keys exist). A ``"shared"`` layer of GLM-5's
    ``indexer_types`` (no indexer: it reuses the last full layer's top-k) gets that layer's keys, as
    sglang captures them (``forward_mla.py``: ``maybe_capture_indexer_topk(layer_id, prev_topk_indices)``).
    """

    def __init__(self, model: PreTrainedModel):
        self.num_layers = int(model.config.num_hidden_layers)
        self.index_topk = int(model.config.index_topk)
        self.indexers = []
        for name, m in model.named_modules():
            if type(m).__name__ in INDEXER_CLASSES:
                match = _LAYER_RE.search(name)
                if match is None:
                    raise ValueError(f"indexer {name}: no decoder layer index in its name")
                self.indexers.append((int(match.group(1)), m))
        types = getattr(model.config, "indexer_types", None) or []
        self.reuses = {i: max(j for j in range(i) if types[j] == "full") for i, t in enumerate(types) if t == "shared"}
        if not self.indexers:
            raise ValueError(f"{type(model).__name__}: no DSA indexer of {INDEXER_CLASSES} to return indexer_topk from")
        self._seen: dict[int, torch.Tensor] = {}
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in self.indexers]

    def _hook(self, layer: int):
        def hook(module, args, output):
            self._seen[layer] = output.detach().to(torch.int64).cpu()

        return hook

    def take(self, pads: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The last forward's selection: int32 [B, S, num_hidden_layers, index_topk] of key positions
        (-1: none). pads: [B] left padding of each row; positions: [B, S] each query's position."""
        b, s = positions.shape
        out = torch.full((b, s, self.num_layers, self.index_topk), -1, dtype=torch.int32)
        pads, positions = pads.cpu().to(torch.int64), positions.cpu().to(torch.int64)
        for layer, _ in self.indexers:
            if layer not in self._seen:
                raise RuntimeError(f"indexer of layer {layer} did not run in the last forward")
            idx = self._seen[layer]  # [B, S, k]
            pos = idx - pads.view(b, 1, 1)
            valid = (pos >= 0) & (pos <= positions.unsqueeze(-1))
            big = torch.iinfo(torch.int64).max
            keys = torch.where(valid, pos, big).sort(-1).values
            keys = torch.where(keys == big, -1, keys)[..., : self.index_topk]
            out[:, :, layer, : keys.shape[-1]] = keys.to(torch.int32)
        for layer, full in self.reuses.items():
            out[:, :, layer] = out[:, :, full]
        self._seen.clear()
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
