"""After a sync, check that every engine serves the trainer's weights (``rollout.sync_verify``).

Works against real SGLang for every family (sglang 0.5.23's ``get_weights_by_name`` exists only for
Llama-style models), so it compares what the engines compute rather than what they store:

1. :func:`check_versions`, after every sync (cheap: one ``/model_info`` call per engine): each engine
   reports the weight version of the sync just done (``weight_version``, set by every update call);
   a stale engine fails here;
2. :func:`check_engines`, on the syncs ``rollout.sync_verify_every`` picks (the first one always):
   each engine generates greedily (top_k = 1, temperature 1: SGLang then reports log softmax of the
   raw logits) a few tokens for a fixed probe batch; the trainer scores the same tokens with its own
   forward (``score.score_rows``: every layout, every rank); the largest absolute log-prob
   difference must be within ``tol``. A layer left with old or wrong weights (e.g. a fused parameter
   whose parts a loader dropped) moves log-probs far beyond the bf16 noise of a correct sync.

The probe generates, so a colocated engine must hold its KV cache while it runs (sglang runs a
request on whatever its KV pool maps; on a released one that is an illegal memory access): the
caller passes ``generation``, a context manager entered on every rank around rank 0's generation
(``rollout.session`` resumes the KV cache there, offloading the training state first with
``rollout.offload_train``), and the trainer scores after it.

Collective: every rank calls :func:`check_engines`; the engines are driven by rank 0 only, the
verdict is broadcast, so a failed check stops every rank at once and never leaves one waiting.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.runtime.distributed import broadcast_object


def default_tolerance(dtype: str, fp8: bool = False) -> float:
    """Max abs log-prob difference accepted when ``rollout.sync_verify_tol`` is 0: engine and trainer
    compute the same function with different kernels; fp32 agrees to ~1e-5, bf16 to ~1e-1 on
    single tokens; an engine fed FP8-quantized weights (``rollout.sync_fp8``) is further off, still
    far below what a stale or missing layer does."""
    if fp8:
        return 1.0
    return 1e-3 if dtype == "float32" else 0.25


def check_versions(engine, version: str) -> str | None:
    """Rank 0: None when every engine reports ``version`` (an engine that reports none is not
    checked), otherwise the problem in one line."""
    try:
        versions = engine.weight_versions()
    except Exception as e:  # noqa: BLE001 - an engine that does not answer: the caller decides
        return f"weight version check failed: {type(e).__name__}: {e}"
    stale = [(i, v) for i, v in enumerate(versions) if v is not None and v != version]
    if not stale:
        return None
    return (f"engine {stale[0][0]} reports weight version {stale[0][1]!r} after sync {version!r} "
            f"({len(stale)} of {len(versions)} engines stale): the sync did not reach it")


@dataclass
class ProbeResult:
    ok: bool
    message: str
    max_abs_diff: float


def check_engines(model, engine, version: str, prompts: list[list[int]] | None, tol: float, pad_id: int = 0,
                  max_new_tokens: int = 4, generation: Callable = nullcontext) -> ProbeResult:
    """Collective (see module docstring). ``engine`` and ``prompts`` on rank 0 only. ``generation()``:
    entered on every rank around rank 0's generation (the engines' KV cache must be resumed there)."""
    from gspo_megatron.score import score_rows

    rank = rdist.rank()
    rows, samples, problem = None, None, None
    if rank == 0:
        problem = check_versions(engine, version)
    problem = broadcast_object(problem)
    if problem:
        return ProbeResult(False, problem, float("inf"))
    with generation():
        if rank == 0:
            try:
                params = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=max_new_tokens)
                samples = engine.generate_on_each(prompts, params)
                rows = [list(s.prompt_ids) + list(s.response_ids) for per_engine in samples for s in per_engine]
            except Exception as e:  # noqa: BLE001 - becomes the verdict on every rank
                problem = f"probe generation failed: {type(e).__name__}: {e}"
        rows = broadcast_object(None if problem else rows)
    if rows is None:
        return ProbeResult(False, broadcast_object(problem), float("inf"))
    scored = score_rows(model, rows, pad_id=pad_id)  # rank 0: full-row log-probs, position 1..
    verdict = None
    if rank == 0:
        worst, where, k = 0.0, "", 0
        for e, per_engine in enumerate(samples):
            for p, s in enumerate(per_engine):
                trainer = scored[k][len(s.prompt_ids) - 1:]
                k += 1
                for t, (a, b) in enumerate(zip(trainer, s.response_logprobs)):
                    if abs(a - b) > worst:
                        worst, where = abs(a - b), f"engine {e}, probe prompt {p}, token {t}"
        ok = worst <= tol
        message = "" if ok else (f"engine log-probs differ from the trainer's by {worst:.3g} (> rollout.sync_verify_tol "
                                 f"{tol:g}) at {where}: the engine does not hold the trainer's weights")
        verdict = ProbeResult(ok, message, worst)
    return broadcast_object(verdict)
