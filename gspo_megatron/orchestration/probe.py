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
   With ``rollout.routing_replay=r3`` the engines return each probe token's routed experts (the
   engine is built asking for them) and the trainer's probe forward replays them
   (``trainer.route_replay.replay_phase``): an MoE engine whose router picks other experts (bf16
   kernels, or the CPU server's ``--router-logit-perturbation``) is then compared on the same routing,
   as the training forwards are. r2 and off compare each side's own routing.

The probe generates, so a colocated engine must hold its KV cache while it runs (sglang runs a
request on whatever its KV pool maps; on a released one that is an illegal memory access): the
caller passes ``generation``, a context manager entered on every rank around rank 0's generation
(``orchestration.colocation.Colocation.for_probe`` resumes the KV cache there, offloading the training
state first with ``rollout.offload_train``), and the trainer scores after it. :class:`SyncVerifier`
runs both on their schedule; the trainer builds it and hands it to ``RolloutSession``.

Collective: every rank calls :func:`check_engines`; the engines are driven by rank 0 only, the
verdict is broadcast, so a failed check stops every rank at once and never leaves one waiting.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

from gspo_megatron.engines.base import SamplingParams
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
    return (
        f"engine {stale[0][0]} reports weight version {stale[0][1]!r} after sync {version!r} "
        f"({len(stale)} of {len(versions)} engines stale): the sync did not reach it"
    )


@dataclass
class ProbeResult:
    ok: bool
    message: str
    max_abs_diff: float


def check_engines(
    model,
    engine,
    version: str,
    prompts: list[list[int]] | None,
    tol: float,
    pad_id: int = 0,
    max_new_tokens: int = 4,
    generation: Callable = nullcontext,
    routing_replay: str = "off",
) -> ProbeResult:
    """Collective (see module docstring). ``engine`` and ``prompts`` on rank 0 only. ``generation()``:
    entered on every rank around rank 0's generation (the engines' KV cache must be resumed there).
    ``routing_replay`` ``"r3"``: the trainer replays the probe samples' ``routed_experts`` (int32
    [P + R - 1, layers, topk] each; a sample without them is scored with the trainer's own routing)
    and, for DSA models, their ``indexer_topk`` (int32 [P + R - 1, layers, index_topk])."""
    from gspo_megatron.score import score_rows
    from gspo_megatron.trainer.route_replay import replay_phase

    rank = rdist.rank()
    rows, routes, samples, problem, indexer = None, None, None, None, None
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
                if routing_replay == "r3":
                    routes = [getattr(s, "routed_experts", None) for per_engine in samples for s in per_engine]
                    routes = routes if all(r is not None for r in routes) else None
                    indexer = [getattr(s, "indexer_topk", None) for per_engine in samples for s in per_engine]
                    indexer = indexer if routes is not None and all(r is not None for r in indexer) else None
            except Exception as e:  # noqa: BLE001 - becomes the verdict on every rank
                problem = f"probe generation failed: {type(e).__name__}: {e}"
        rows, routes, indexer = broadcast_object((None, None, None) if problem else (rows, routes, indexer))
    if rows is None:
        return ProbeResult(False, broadcast_object(problem), float("inf"))
    with replay_phase(model, "r3" if routes is not None else "off", "policy"):
        scored = score_rows(
            model, rows, pad_id=pad_id, routes=routes, indexer=indexer
        )  # rank 0: full-row log-probs, position 1..
    verdict = None
    if rank == 0:
        if samples is None or scored is None:  # rank 0 generated the rows (rows is not None) and scored them
            raise RuntimeError("sync probe: rank 0 holds no probe samples or scores")
        worst, where, k = 0.0, "", 0
        for engine_i, per_engine in enumerate(samples):
            for p, s in enumerate(per_engine):
                trainer = scored[k][len(s.prompt_ids) - 1 :]
                k += 1
                for t, (a, b) in enumerate(zip(trainer, s.response_logprobs)):
                    if abs(a - b) > worst:
                        worst, where = abs(a - b), f"engine {engine_i}, probe prompt {p}, token {t}"
        ok = worst <= tol
        message = (
            ""
            if ok
            else (
                f"engine log-probs differ from the trainer's by {worst:.3g} (> rollout.sync_verify_tol "
                f"{tol:g}) at {where}: the engine does not hold the trainer's weights"
            )
        )
        verdict = ProbeResult(ok, message, worst)
    return broadcast_object(verdict)


class SyncVerifier:
    """Every rank: the check ``RolloutSession`` runs after each sync (``rollout.sync_verify``), built
    by the trainer and handed to the session (which imports nothing of the check): the weight
    version after every sync (:func:`check_versions`), and the log-prob probe (:func:`check_engines`)
    on the first sync, the first after an engine restart and every ``every``-th (0: never).

    model: this rank's policy chunk (the trainer's side of the probe); probe_prompts: rank 0's
    probe batch (None elsewhere). Every rank keeps the same schedule (same counters).
    routing_replay: ``rollout.routing_replay``; ``"r3"``: the probe replays the engines' routes."""

    def __init__(
        self,
        model,
        tolerance: float,
        pad_id: int = 0,
        probe_prompts: list[list[int]] | None = None,
        every: int = 1,
        routing_replay: str = "off",
    ):
        self.model, self.tolerance, self.pad_id = model, tolerance, pad_id
        self.routing_replay = routing_replay
        self.probe_prompts, self.every = probe_prompts, every
        self.probe_owed = False  # an engine was restarted: its first sync is probed

    def engine_restarted(self) -> None:
        self.probe_owed = True

    def probe_due(self, syncs: int) -> bool:
        """Whether the sync after ``syncs`` successful ones runs the log-prob probe."""
        if self.every <= 0:
            return False
        return self.probe_owed or syncs % self.every == 0

    def check(self, engine, version: str, syncs: int, metrics: dict, generation: Callable = nullcontext) -> str | None:
        """Collective, after a sync: None when the engines pass, else the problem (the same on every
        rank). ``generation``: see :func:`check_engines`; the probe's difference goes to ``metrics``."""
        if not self.probe_due(syncs):
            return broadcast_object(check_versions(engine, version) if rdist.rank() == 0 else None)
        result = check_engines(
            self.model,
            engine,
            version,
            self.probe_prompts,
            self.tolerance,
            self.pad_id,
            generation=generation,
            routing_replay=self.routing_replay,
        )
        metrics["sync/verify_max_abs_diff"] = result.max_abs_diff
        if result.ok:
            self.probe_owed = False
            return None
        return result.message
