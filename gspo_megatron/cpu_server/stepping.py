"""The worker's generation commands (a mixin of ``worker.TPWorker``): requests live in rank 0's
:class:`~gspo_megatron.cpu_server.scheduler.StepScheduler` across commands, and the HTTP front drives
them one scheduler iteration (``step``) at a time, so that every other command (a weight update, a
pause, an abort, a flush) runs between two tokens, as sglang's scheduler handles its control
requests between two forward batches (``event_loop_normal``: ``ingest_requests`` then one batch).

Commands (every TP rank runs each; only rank 0 holds requests, the other ranks answer success):
``submit`` (validate and queue), ``step`` (one iteration; rebuilds rank 0's model first when the
shards changed: collective), ``pause`` / ``continue`` (``Scheduler.pause_generation`` /
``continue_generation``), ``abort_all`` (``Scheduler.abort_request``), ``record_version``
(``handle_update_weight_version``). After a weight update that loaded (``after_update``): the
version change is recorded on the live requests, then, with ``flush_cache`` (sglang's default True),
a flush refused because requests run fails the update call with sglang's message
(``scheduler_components/weight_updater.py`` ``flush_cache_after_weight_update``): the weights stay
updated.
"""

from __future__ import annotations

import dataclasses
import traceback
from typing import TYPE_CHECKING, Any, Callable

import torch

from gspo_megatron.cpu_server.generation import normalize, released_refusal, routed_start
from gspo_megatron.cpu_server.prompt_logprobs import resolve
from gspo_megatron.cpu_server.scheduler import LiveReq, StepScheduler, new_live, update_finish
from gspo_megatron.cpu_server.sglang_runtime import SchedulerDeath
from gspo_megatron.engines.base import SamplingParams

if TYPE_CHECKING:
    from gspo_megatron.cpu_server.args import ServerArgs
    from gspo_megatron.cpu_server.lora import WorkerLoras

# scheduler_components/weight_updater.py flush_cache_after_weight_update
FLUSH_REFUSED_AFTER_UPDATE = (
    "Weights were updated, but the cache was not flushed because requests are still running or "
    "queued. Retract or finish them, then call /flush_cache."
)


class SchedulingOps:
    """Generation commands of a TP rank (mixed into ``TPWorker``; uses its sampler, loras, dirty)."""

    # provided by ``worker.TPWorker`` (set in its ``__init__`` or defined there)
    sched: StepScheduler
    args: ServerArgs
    tp_rank: int
    offload_tags: set[str]
    eos_ids: list[int]
    generator: torch.Generator
    dirty: bool
    sampler: Any  # generation.Sampler | None: None until rank 0's first _refresh_full_model
    loras: WorkerLoras
    _refresh_full_model: Callable[[], None]
    update_tensor: Callable[..., dict]
    update_distributed: Callable[..., dict]

    def _released(self) -> list[str]:
        return sorted(self.offload_tags) if self.args.enable_memory_saver else []

    def _state(self, **kw: Any) -> dict:
        return {"success": True, **self.sched.state(), **kw}

    def op_submit(self, requests: list[dict], rids: list[str]) -> dict:
        released = self._released()
        if released:  # sglang would run the batch on unmapped memory (see ``released_refusal``)
            return {"success": False, "message": released_refusal(released), "released": released}
        if self.tp_rank != 0:
            return {"success": True}
        try:
            reqs = [
                normalize(r["input_ids"], r["sampling_params"], self.eos_ids, self.args.enable_deterministic_inference)
                for r in requests
            ]
            # the scheduler's logprob_start_len rules before its routed_experts_start_len check (scheduler.py)
            spec = bool(self.args.speculative_algorithm)
            reqs = [
                dataclasses.replace(
                    q,
                    logprob=resolve(
                        bool(r.get("return_logprob")),
                        int(r.get("logprob_start_len", -1)),
                        int(r.get("top_logprobs_num", 0)),
                        len(q.input_ids),
                        spec,
                    ),
                )
                for q, r in zip(reqs, requests)
            ]
            if self.args.enable_return_routed_experts:
                reqs = [dataclasses.replace(q, routed_start=routed_start(r)) for q, r in zip(reqs, requests)]
            if self.args.enable_return_indexer_topk:
                reqs = [
                    dataclasses.replace(q, indexer=bool(r.get("return_indexer_topk"))) for q, r in zip(reqs, requests)
                ]
        except ValueError as e:
            return {"success": False, "message": str(e), "bad_request": True}
        self.sched.submit(
            [new_live(rid, q, r.get("lora_path"), self.generator) for rid, q, r in zip(rids, reqs, requests)]
        )
        return self._state()

    def op_step(self) -> dict:
        released = self._released()
        if released:  # nothing runs on released memory; what is queued fails (sglang would crash)
            if self.tp_rank != 0:
                return {"success": True}
            failed = {r.rid: released_refusal(released) for r in self.sched.live()}
            self.sched.waiting, self.sched.running = [], []
            return self._state(finished=[], failed=failed)
        if self.dirty:
            self._refresh_full_model()  # collective: every rank runs step
        if self.tp_rank != 0:
            return {"success": True}
        if self.sampler is None:
            raise RuntimeError("TP rank 0 has no assembled model")
        spec = self if self.sampler.speculative is not None else None
        try:
            with torch.no_grad():
                finished = self.sched.step(self._forward_one, spec)
        except SchedulerDeath:  # sglang's scheduler dies of it: so does this rank (rank_loop.py)
            raise
        except Exception as e:  # noqa: BLE001 - the step's requests fail, the server stays up
            traceback.print_exc()
            msg = f"{type(e).__name__}: {e}"
            failed = {r.rid: msg for r in self.sched.live()}
            self.sched.waiting, self.sched.running = [], []
            return self._state(finished=[], failed=failed)
        return self._state(finished=finished)

    def op_pause(self, mode: str) -> dict:
        self.sched.pause(mode)
        return self._state()

    def op_continue(self) -> dict:
        self.sched.resume()
        return self._state()

    def op_abort_all(self) -> dict:
        return self._state(finished=self.sched.abort_all())

    def op_report(self) -> dict:
        """Test-only (``/cpu_server/requests``): every live request's queue, tokens and retractions."""
        rows = [("running", r) for r in self.sched.running] + [("waiting", r) for r in self.sched.waiting]
        return self._state(
            requests=[
                {
                    "state": st,
                    "output_len": len(r.output_ids),
                    "retractions": r.retractions,
                    "kv": r.cache is not None or r.spec_state is not None,
                }
                for st, r in rows
            ]
        )

    def op_drop(self) -> dict:
        """After a failed step: forget every request (their callers were answered with the failure)."""
        self.sched.waiting, self.sched.running = [], []
        return self._state()

    def op_record_version(self, new_version: Any) -> dict:
        self.sched.record_version(new_version)
        return self._state()

    def op_flush_cache(self) -> dict:
        """``Scheduler.flush_cache``: refused (no message: the route answers "Flush cache failed.")
        while requests run, or wait on an engine that is not paused."""
        return {"success": self.sched.flush(), "message": ""}

    def after_update(self, result: dict, weight_version: Any, flush_cache: bool) -> dict:
        """What sglang's ``SchedulerWeightUpdaterManager.update_weights_from_*`` does after a load that
        succeeded: record the version change, then the flush that may fail the call."""
        if not result.get("success"):
            return result
        self.sched.record_version(weight_version)
        if flush_cache and not self.sched.flush():
            return {"success": False, "message": FLUSH_REFUSED_AFTER_UPDATE}
        return result

    def op_update_tensor(self, weight_version: Any = None, flush_cache: bool = True, **kw: Any) -> dict:
        return self.after_update(self.update_tensor(**kw), weight_version, flush_cache)

    def op_update_distributed(self, weight_version: Any = None, flush_cache: bool = True, **kw: Any) -> dict:
        return self.after_update(self.update_distributed(**kw), weight_version, flush_cache)

    def check_idle_for_release(self) -> None:
        """``release_memory_occupation`` asserts ``is_fully_idle(ignore_waiting=_engine_paused)``; the
        AssertionError ends sglang's scheduler (and the server)."""
        if not self.sched.fully_idle(ignore_waiting=self.sched.paused):
            raise SchedulerDeath("AssertionError: release_memory_occupation should be called only when server is idle.")

    # -- rank 0: one forward of one request ------------------------------------------------------
    def _forward_one(self, r: LiveReq, ids: list[int], start: int, keep: int = 1) -> torch.Tensor:
        """The logits [keep, V] of the last ``keep`` of ``ids`` (at positions ``start ...``)."""
        from transformers import DynamicCache

        sampler = self.sampler
        model = sampler.engine.model
        if r.cache is None:
            r.cache = DynamicCache(config=model.config)
        dev = sampler.engine.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        pos = torch.arange(start, start + len(ids), dtype=torch.long, device=dev)[None]
        with self.loras.applied(r.lora, model):
            out = model(
                input_ids=input_ids, position_ids=pos, past_key_values=r.cache, use_cache=True, logits_to_keep=keep
            )
        r.cache = out.past_key_values
        if sampler.recorder is not None:
            r.routes.append(sampler.recorder.take(1, len(ids))[0])
        if sampler.indexer_recorder is not None:
            r.index.append(sampler.indexer_recorder.take(torch.zeros(1, dtype=torch.long), pos)[0])
        return out.logits[0, -keep:]

    def _spec_params(self, r: LiveReq, greedy: bool) -> SamplingParams:
        """The sampling of ``r``'s speculative cycles: the batch's greedy decision, and the tokens left of
        ``max_new_tokens`` since its (re)prefill."""
        q = r.req
        return SamplingParams(
            temperature=0.0 if greedy else q.temperature,
            top_p=q.top_p,
            top_k=-1 if q.top_k >= 1 << 30 else q.top_k,
            max_new_tokens=q.max_new_tokens - r.spec_base,
            stop_token_ids=sorted(q.stop_ids),
        )

    def speculative_start(self, r: LiveReq, greedy: bool) -> None:
        """A request's prefill through the speculative decoder (``speculative.py``): the target's forward of
        ``prompt + output_ids`` (a retracted request's prefix again) and one token."""
        q = r.req
        if q.indexer and self.sampler.indexer_recorder is not None:
            raise ValueError("return_indexer_topk with speculative decoding: not served by the CPU server")
        r.spec_base = len(r.output_ids)
        with self.loras.applied(r.lora, self.sampler.engine.model):
            r.spec_state = self.sampler.speculative.start(
                list(q.input_ids) + r.output_ids, self._spec_params(r, greedy), r.generator, q.stop_ids, r.spec
            )
        r.spec = r.spec_state.counts
        self._spec_commit(r)

    def speculative_cycle(self, r: LiveReq, greedy: bool) -> None:
        """One draft-verify-accept cycle of a running request (one decode step of sglang's EAGLE worker)."""
        state = r.spec_state
        state.params = self._spec_params(r, greedy)
        with self.loras.applied(r.lora, self.sampler.engine.model):
            self.sampler.speculative.cycle(state)
        self._spec_commit(r)

    def _spec_commit(self, r: LiveReq) -> None:
        """The request's tokens, log-probs and routes as its speculative state holds them now, and its finish
        (``scheduler.update_finish``: its state's ``max_new_tokens`` is what was left of the request's)."""
        state = r.spec_state
        r.output_ids = r.output_ids[: r.spec_base] + state.out_ids
        r.logprobs = r.logprobs[: r.spec_base] + state.logps
        if state.routes is not None:
            r.routes = [state.route_rows()]
        update_finish(r, state.stopped)
