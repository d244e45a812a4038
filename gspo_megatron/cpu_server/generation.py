"""Sampling on TP rank 0 with the transformers model code, as SGLang 0.5.23's sampler decides it.

Rank 0 holds an :class:`~gspo_megatron.engines.hf_engine.HFRolloutEngine` whose weights are the
TP shards of every rank, gathered and assembled after each change (``worker.TPWorker``); this
module only turns SGLang sampling params into calls of that engine and its outputs back into
SGLang's per-request result.

SGLang rules mirrored (``sampling/sampling_params.py``, ``sampling/sampling_batch_info.py``,
``layers/sampler.py``):
- ``temperature < 1e-6`` becomes ``temperature = 1, top_k = 1``; ``top_k = -1`` becomes
  ``TOP_K_ALL`` (the whole vocabulary); defaults ``max_new_tokens = 128``, ``temperature = top_p = 1``;
- log-probs are ``log_softmax(logits / T)`` of the unfiltered distribution, except in a batch where
  every request has ``top_k <= 1`` (``is_all_greedy``): then ``log_softmax(logits)`` and argmax;
  the batch is one scheduler iteration's requests (``scheduler.py``; the per-request loop of
  ``scheduler.StepScheduler`` serves the HTTP server, :class:`Sampler` holds rank 0's engine);
- ``sampling_seed`` is used only with ``--enable-deterministic-inference`` (default 42 when a
  request has none); otherwise the server's own generator draws, seeded by ``--random-seed`` once at
  start (sglang's ``set_random_seed`` in ``managers/tp_worker.py``): memory release / resume and
  weight updates do not reseed it, so each step draws a new stream;
- generation stops at ``stop_token_ids`` and at the model's EOS ids unless ``ignore_eos``;
- routed experts (``--enable-return-routed-experts``, request ``return_routed_experts`` /
  ``routed_experts_start_len``): the router ids of this forward (``cpu_server/routes.py``) over
  ``[routed_experts_start_len, seqlen - 1)``, int32 [tokens, num_hidden_layers, topk] (``engines/routing.py``);
  a start outside ``[0, prompt_tokens]`` is refused with sglang's message;
- indexer top-k of DSA models (``--enable-return-indexer-topk``, request ``return_indexer_topk``): the
  indexer selection of this forward (``cpu_server/routes.IndexerRecorder``) over ``[0, seqlen - 1)``,
  int32 [tokens, num_hidden_layers, index_topk] of key positions, -1 where fewer keys exist;
- with ``--speculative-algorithm`` each request decodes alone through ``cpu_server/speculative.py``
  (the checkpoint's MTP layer drafts, the target verifies with sglang's acceptance rule): the same
  sampling parameters, log-probs and stop rules, plus the request's speculative counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gspo_megatron.cpu_server.prompt_logprobs import LogprobAsk
from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.hf_engine import HFRolloutEngine

SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30  # sglang's "whole vocabulary"
DEFAULT_SEED = 42  # sglang's sampling_seed when deterministic inference is on and none is given

# SamplingParams fields of sglang 0.5.23 (an unknown key is refused, as msgspec does there).
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "beam_width",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
        "custom_params",
        "watermark",
    }
)
# Keys the CPU stand-in implements only at their defaults (a non-default value is refused).
_DEFAULT_ONLY = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "beam_width": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "stop": None,
    "stop_regex": None,
    "logit_bias": None,
    "custom_params": None,
    "watermark": None,
}


@dataclass(frozen=True)
class Request:
    """One normalized request: what the sampler needs."""

    input_ids: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int  # TOP_K_ALL: whole vocabulary
    max_new_tokens: int
    stop_ids: frozenset[int]
    seed: int | None  # only with deterministic inference
    routed_start: int | None = None  # return_routed_experts: routed_experts_start_len; None: not asked
    indexer: bool = False  # return_indexer_topk (DSA, server --enable-return-indexer-topk): asked
    logprob: LogprobAsk | None = None  # return_logprob: its start / top-k (prompt_logprobs.resolve)


def normalize(input_ids: Sequence[int], sp: dict[str, Any], eos_ids: Sequence[int], deterministic: bool) -> Request:
    """SGLang's SamplingParams defaults / normalization / verify; ValueError names the field."""
    unknown = sorted(set(sp) - SGLANG_SAMPLING_KEYS)
    if unknown:
        raise ValueError(f"sampling_params: unknown field(s) {unknown}")
    for key, default in _DEFAULT_ONLY.items():
        if sp.get(key) is not None and sp.get(key) != default:
            raise ValueError(f"sampling_params.{key}={sp[key]!r}: not implemented by the CPU server (only {default!r})")
    t = 1.0 if sp.get("temperature") is None else float(sp["temperature"])
    top_p = 1.0 if sp.get("top_p") is None else float(sp["top_p"])
    top_k = -1 if sp.get("top_k") is None else int(sp["top_k"])
    max_new = 128 if sp.get("max_new_tokens") is None else int(sp["max_new_tokens"])
    if not t >= 0.0 or t == float("inf"):
        raise ValueError(f"temperature must be a non-negative finite number, got {t}.")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    if top_k < 1 and top_k != -1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
    if 0 <= t < SAMPLING_EPS:
        t, top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    stop = {int(x) for x in (sp.get("stop_token_ids") or []) if x is not None}
    if not sp.get("ignore_eos"):
        stop |= set(eos_ids)
    seed = None
    if deterministic:
        seed = DEFAULT_SEED if sp.get("sampling_seed") is None else int(sp["sampling_seed"])
    return Request(tuple(int(i) for i in input_ids), t, top_p, top_k, max_new, frozenset(stop), seed)


def eos_token_ids(model_path: str, config: Any) -> list[int]:
    """The model's EOS ids (config.json, then generation_config.json), as sglang's ModelConfig reads them."""
    ids: list[int] = []
    for src in (getattr(config, "eos_token_id", None), _generation_eos(model_path)):
        if src is None:
            continue
        ids += [int(x) for x in (src if isinstance(src, (list, tuple)) else [src])]
    return sorted(set(ids))


def _generation_eos(model_path: str):
    import json

    path = os.path.join(model_path, "generation_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("eos_token_id")


class Sampler:
    """Rank 0's generation: groups requests with equal params and runs HFRolloutEngine batches."""

    def __init__(
        self,
        engine: HFRolloutEngine,
        generator: torch.Generator,
        recorder: Any = None,
        indexer_recorder: Any = None,
        speculative: Any = None,
    ):
        self.engine = engine
        self.speculative = speculative  # cpu_server.speculative.SpeculativeDecoder, or None
        self.recorder = recorder  # cpu_server.routes.RouteRecorder on engine.model, or None
        self.indexer_recorder = indexer_recorder  # cpu_server.routes.IndexerRecorder (DSA), or None
        # the server's generator (seeded once at start by --random-seed, kept through release /
        # resume and weight updates, as sglang's sampling RNG is): never reseeded here
        self.generator = generator

    @torch.no_grad()
    def run(self, requests: Sequence[Request]) -> list[dict]:
        """One result per request: ``{"output_ids", "logprobs", "finish": {"type", ...}}``."""
        all_greedy = all(r.top_k <= 1 for r in requests)
        results: list[dict | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            if r.max_new_tokens == 0:
                results[i] = {"output_ids": [], "logprobs": [], "finish": {"type": "length", "length": 0}}
                continue
            key = (r.temperature, r.top_p, r.top_k, r.max_new_tokens, r.stop_ids)
            # per-request seeds: each request alone with its own generator (batch invariant)
            groups.setdefault(key + ((i,) if r.seed is not None else ()), []).append(i)
        for key, idx in groups.items():
            r = requests[idx[0]]
            params = SamplingParams(
                temperature=0.0 if all_greedy else r.temperature,
                top_p=r.top_p,
                top_k=-1 if r.top_k == TOP_K_ALL else r.top_k,
                max_new_tokens=r.max_new_tokens,
                stop_token_ids=sorted(r.stop_ids),
            )
            gen = self.generator if r.seed is None else torch.Generator(device="cpu").manual_seed(r.seed)
            if self.speculative is not None:
                for i in idx:
                    results[i] = self._speculative(requests[i], params, gen)
                continue
            prompts = [list(requests[i].input_ids) for i in idx]
            for start in range(0, len(prompts), self.engine.max_batch_size):
                chunk = prompts[start : start + self.engine.max_batch_size]
                samples = self.engine._generate_batch(chunk, params, gen, self.recorder, self.indexer_recorder)
                for i, s in zip(idx[start : start + len(chunk)], samples):
                    finish = (
                        {"type": "stop", "matched": s.response_ids[-1]}
                        if s.finish_reason == "stop"
                        else {"type": "length", "length": r.max_new_tokens}
                    )
                    out: dict = {"output_ids": s.response_ids, "logprobs": s.response_logprobs, "finish": finish}
                    results[i] = out
                    start_len = requests[i].routed_start
                    if start_len is not None and s.routed_experts is not None:
                        out["routed_experts"] = s.routed_experts[min(start_len, len(s.routed_experts)) :]
                    if requests[i].indexer and s.indexer_topk is not None:  # sglang: always [0, seqlen - 1)
                        out["indexer_topk"] = s.indexer_topk
        done = [res for res in results if res is not None]
        if len(done) != len(requests):  # the engine returns one sample per prompt
            raise RuntimeError(f"generation returned {len(done)} results for {len(requests)} requests")
        return done

    def _speculative(self, request: Request, params: SamplingParams, gen: torch.Generator) -> dict:
        """One request through the speculative decoder: the result of :meth:`run` plus ``spec`` (its counts)."""
        if request.indexer and self.indexer_recorder is not None:
            raise ValueError("return_indexer_topk with speculative decoding: not served by the CPU server")
        s = self.speculative.generate(request.input_ids, params, gen, request.stop_ids)
        ids = s["output_ids"]
        finish = (
            {"type": "stop", "matched": ids[-1]}
            if s["stopped"]
            else {"type": "length", "length": request.max_new_tokens}
        )
        out: dict = {"output_ids": ids, "logprobs": s["logprobs"], "finish": finish, "spec": s["spec"]}
        start_len = request.routed_start
        if start_len is not None and s.get("routes") is not None:
            routes = s["routes"].to(torch.int32).numpy()
            out["routed_experts"] = routes[min(start_len, len(routes)) :]
        return out


def routed_start(request: dict) -> int | None:
    """sglang's scheduler check of ``routed_experts_start_len`` (None: routes not asked for)."""
    if not request.get("return_routed_experts"):
        return None
    start = int(request.get("routed_experts_start_len") or 0)
    if start < 0:
        raise ValueError(
            f"recv_req.routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if start > len(request["input_ids"]):
        raise ValueError(
            f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={len(request['input_ids'])}. Please use a smaller "
            "routed_experts_start_len."
        )
    return start


def released_refusal(tags: list[str]) -> str:
    """Why a generation is refused while memory is released. sglang 0.5.23 itself does not refuse:
    its scheduler runs the request (``/generate``, and the one-token request of ``/health_generate``)
    on whatever its KV pool and weights map, and after ``release_memory_occupation`` with the
    memory saver that memory is unmapped (``scheduler_components/weight_updater.py``: torch_memory_saver
    ``pause``), which on a GPU is an illegal memory access that ends the server."""
    return (
        f"{', '.join(repr(t) for t in tags)} released (release_memory_occupation): sglang 0.5.23 would "
        "run this generation on unmapped memory (an illegal memory access on a GPU); "
        "resume_memory_occupation first"
    )
