"""The rollout-engine interface shared by the CPU (transformers) engine and the SGLang engine.

Called by the trainer on global rank 0 only (engines are driven from one place; other ranks take
part in the weight export collectives but never call the engine).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch


@dataclass
class SamplingParams:
    """Sampling settings, applied identically by every engine.

    temperature scales logits before softmax; the engine's returned log-probs are those of the
    temperature-scaled, *unfiltered* distribution (top-p / top-k change which token is drawn, not the
    reported log-prob), which is also what the trainer recomputes.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class RolloutSample:
    """One generated response.

    prompt_ids: the prompt's token ids; response_ids: generated ids (stop token included when one
    ended it); response_logprobs: the engine's log p(response_ids[t] | ...), len == len(response_ids);
    finish_reason: "stop" (a stop token) or "length" (max_new_tokens); token_versions: the engine's
    weight version (the sync's version string) that produced each response token, None when the
    engine does not report it; routed_experts: the engine's MoE routes, int32 numpy
    [P + R - 1, num_layers, topk] (``engines/routing.py``), None unless asked for; indexer_topk:
    DSA models, the engine's indexer selection, int32 numpy [P + R - 1, num_layers, index_topk] (key
    positions, -1 where fewer keys exist), None unless asked for; spec_verify_ct /
    spec_num_correct_drafts / spec_num_proposed_drafts: a speculatively decoding engine's counts for
    this response (sglang 0.5.23 ``meta_info``, ``managers/tokenizer_manager.py``
    ``_calculate_spec_decoding_metrics``: target verify forwards, accepted draft tokens, and
    ``verify_ct * (num_draft_tokens - 1)`` proposed draft tokens; the bonus token of each verify is in
    none of them), 0 when the engine reports none (no speculation, or a response from the prefill alone).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    token_versions: list[str] | None = None
    routed_experts: Any = None
    indexer_topk: Any = None
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0


class RolloutEngine(abc.ABC):
    """A generator of G samples per prompt that receives new weights after every optimizer step."""

    @abc.abstractmethod
    def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        """Return, for each prompt (token ids), a list of n samples."""

    def generate_stream(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> Iterator[list[tuple[int, list[RolloutSample]]]]:
        """The groups of ``generate`` as they are delivered: each item is a list of (prompt index,
        its n samples). Closing the iterator early tells the engine that the remaining groups are
        not wanted (over-sampling). Default: one delivery with every group, from one ``generate``."""
        yield list(enumerate(self.generate(prompts, n, params)))

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """In-process engines (``weight_sync.transport.InProcessTransport``): load one bucket of full
        (unsharded) tensors named in the Hugging Face checkpoint layout (e.g.
        ``model.layers.0.mlp.experts.3.gate_proj.weight``). Called repeatedly per sync, between
        ``begin_weight_update`` and ``end_weight_update``. Engines in other processes (SGLang) get
        their weights through a transport instead."""
        raise NotImplementedError(f"{type(self).__name__} receives weights through a transport")

    def generate_on_each(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[RolloutSample]]:
        """One sample per prompt from every engine replica: [engine][prompt] (the post-sync check)."""
        return [[g[0] for g in self.generate(prompts, 1, params)]]

    def take_served(self) -> list[int]:
        """Generate requests each engine replica answered since the last call ([] if not counted)."""
        return []

    def weight_versions(self) -> list[str | None]:
        """Each engine replica's weight version as it reports it (None: not reported)."""
        return [None]

    def begin_weight_update(self) -> None:
        """Pause generation / flush caches before a sync (no-op by default)."""

    def end_weight_update(self) -> None:
        """Resume generation after a sync (no-op by default)."""

    def release_memory(self, tags: Sequence[str] | None = None, engines: Sequence[int] | None = None) -> None:
        """Colocated mode: free GPU memory while the trainer runs (``tags``: None: everything;
        ``engines``: the replicas, None: all). No-op by default."""

    def resume_memory(self, tags: Sequence[str] | None = None) -> list[int] | None:
        """Colocated mode: take GPU memory back (``tags``: e.g. ["weights"] before a sync,
        ["kv_cache"] after it; None: everything). Returns the replicas that took something back
        (None: not tracked). No-op by default."""

    def health_check(self) -> bool:
        """True when the engine can serve requests."""
        return True

    def restart(self) -> None:
        """Bring a dead engine back (weights must be re-synced after). Default: unsupported."""
        raise RuntimeError(f"{type(self).__name__} cannot be restarted")

    def shutdown(self) -> None:
        """Release the engine's resources."""
