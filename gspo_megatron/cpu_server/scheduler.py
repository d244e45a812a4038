"""The CPU server's scheduler on TP rank 0: requests live across commands, one forward per step, so
that pause / continue / weight updates / aborts happen between tokens as in sglang 0.5.23's
scheduler (``srt/managers/scheduler.py``: ``event_loop_normal``, ``pause_generation``,
``continue_generation``, ``abort_request``, ``flush_cache``, ``record_weight_version_change``).

A request (:class:`LiveReq`) is ``waiting`` (no KV cache: new, or retracted) or ``running`` (its own
transformers ``DynamicCache``). One :meth:`StepScheduler.step` is one iteration of sglang's
``event_loop_normal``: nothing while the engine is paused (``_engine_paused``); else, when requests
wait, one prefill ("extend") of every waiting request over ``prompt + output_ids`` (a retracted
request's prefix is recomputed under the weights loaded now), else one decode forward of every
running request. Each forward samples one token (sglang's sampler rules, ``generation.py``); a
request finishes after the token that ends it (``Req.update_finish_state``: ``to_finish`` first,
then a stop token, then ``max_new_tokens``). Forwards are per request (batch of one, no padding), and
``is_all_greedy`` is decided over the requests of the step's batch, as sglang's
``SamplingBatchInfo`` does. With ``--speculative-algorithm`` a request's prefill samples its first
token and each decode step is one draft-verify-accept cycle of it (``speculative.py``), so speculative
requests pause, update and retract between cycles like the others. With ``--max-running-requests`` N,
at most N requests run: a prefill takes the waiting requests in arrival order while fewer than N run,
and with none of them admitted the step decodes (``managers/scheduler.py`` ``get_num_allocatable_reqs``:
``pp_max_micro_batch_size - running_bs`` new requests, the request pool sized from N by
``mem_cache/kv_cache_configurator.py`` ``resolve_max_num_reqs``: ``max(1, N)``).

Weight versions (``srt/utils/weight_versions.py``): a version change records, on every live request
with output tokens, ``(old_version, len(output_ids))``; at finish the spans are
:func:`version_spans` (``compute_weight_version_spans``) and the front turns them into
``meta_info.weight_versions`` / ``weight_version`` (:func:`add_weight_versions_to_meta_info`). A
token sampled after an update (in place, or after a retract's re-prefill) carries the new version.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gspo_megatron.cpu_server import prompt_logprobs as plp
from gspo_megatron.cpu_server.generation import TOP_K_ALL, Request
from gspo_megatron.cpu_server.sglang_runtime import SchedulerDeath
from gspo_megatron.engines.base import SamplingParams

# sglang envs.SGLANG_FORCE_STREAM_INTERVAL (srt/environ.py): a non-streaming request's output reaches
# the tokenizer manager every this many tokens (output_streamer.py ``accept``) and when finished
FORCE_STREAM_INTERVAL = int(os.environ.get("SGLANG_FORCE_STREAM_INTERVAL", "50"))
# sglang FINISH_ABORT() (schedule_batch.py) as its to_json() writes it; a running request aborted by
# AbortReq gets it (scheduler.py ``abort_request``: "Abort method 3: set to_finish")
FINISH_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
# tokenizer_manager.py ``_handle_abort_req``: a request aborted in the waiting queue
ABORT_IN_WAITING_QUEUE = {"type": "abort", "message": "Abort in waiting queue"}
PAUSE_MODES = ("abort", "retract", "in_place")  # io_struct.py PauseGenerationReqInput.mode


def version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict]:
    """sglang's ``compute_weight_version_spans``: events ``(old_version, num_output_tokens)``."""
    spans: list[dict] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


def add_weight_versions_to_meta_info(meta: dict, spans: list[dict], n: int) -> None:
    """sglang's ``add_weight_versions_to_meta_info`` (utils/weight_versions.py)."""
    visible = [s for s in spans if s["start"] < n or s["start"] == 0]
    meta["weight_versions"] = [{"version": s["version"], "start": s["start"], "end": min(s["end"], n)} for s in visible]
    meta["weight_version"] = visible[-1]["version"]


@dataclass(eq=False)
class LiveReq:
    rid: str
    req: Request
    lora: str | None
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[list, list]] = field(default_factory=list)  # top_logprobs_num rows, one per logprob
    input_lp: dict | None = None  # prompt log-probs (prompt_logprobs.input_logprobs), once computed
    hidden: int | None = None  # max_new_tokens 0, not prefill-only: the sampled token (logprob only)
    cache: Any = None  # transformers DynamicCache while running; None while waiting (no KV)
    routes: list[torch.Tensor] = field(default_factory=list)  # per forward [tokens, layers, topk]
    index: list[torch.Tensor] = field(default_factory=list)
    events: list[tuple[str, int]] = field(default_factory=list)  # weight version changes
    retractions: int = 0
    to_finish: dict | None = None
    finish: dict | None = None
    spec: Any = None  # speculative.SpecCounts of the request (kept across a retract); None: no speculation
    spec_state: Any = None  # speculative.SpecState while it holds its KV cache (running speculatively)
    spec_base: int = 0  # output tokens before the speculative (re)prefill


class StepScheduler:
    """Rank 0's queues. ``forward(live, ids, start, keep=1) -> logits [keep, V]`` runs one forward of
    one request on the current model (the worker binds the model, LoRA and recorders): the logits of
    its last ``keep`` positions."""

    def __init__(self, version: str = "default", max_running: int | None = None):
        self.max_running = None if max_running is None else max(1, int(max_running))  # None: no limit
        self.waiting: list[LiveReq] = []
        self.running: list[LiveReq] = []
        self.paused = False  # sglang Scheduler._engine_paused (in_place / retract only)
        self.version = version  # sglang get_serving().weight_version (the scheduler's copy)

    # -- state -----------------------------------------------------------------------------------
    def live(self) -> list[LiveReq]:
        return self.running + self.waiting

    def state(self) -> dict:
        return {"live": len(self.running) + len(self.waiting), "paused": self.paused}

    def fully_idle(self, ignore_waiting: bool) -> bool:
        """``Scheduler.is_fully_idle``: no running request (and none waiting unless ignored)."""
        return not self.running and (ignore_waiting or not self.waiting)

    def flush(self) -> bool:
        """``Scheduler.flush_cache``: refused (False) while a request runs, or waits and the engine
        is not paused (``is_fully_idle(ignore_waiting=self._engine_paused)``). The CPU server has no
        radix cache to empty, so a successful flush changes nothing else."""
        return self.fully_idle(ignore_waiting=self.paused)

    # -- requests --------------------------------------------------------------------------------
    def submit(self, reqs: list[LiveReq]) -> None:
        self.waiting.extend(reqs)

    def abort_all(self) -> list[dict]:
        """``Scheduler.abort_request(AbortReq(abort_all=True))``: every waiting request is answered now
        (what the tokenizer manager has of it: :meth:`_waiting_abort`); every running one gets
        ``to_finish = FINISH_ABORT()`` and finishes after one more decode forward."""
        out = [self._waiting_abort(r) for r in self.waiting]
        self.waiting = []
        for r in self.running:
            r.to_finish = dict(FINISH_ABORT)
        return out

    def _waiting_abort(self, r: LiveReq) -> dict:
        # a non-streaming request's tokens reach the tokenizer every FORCE_STREAM_INTERVAL tokens:
        # its abort answer has those (a retracted request may hold more in the scheduler)
        sent = len(r.output_ids) - len(r.output_ids) % FORCE_STREAM_INTERVAL
        return {
            "rid": r.rid,
            "waiting_abort": True,
            "output_ids": r.output_ids[:sent],
            "logprobs": r.logprobs[:sent],
            "top": r.top[:sent],
            # the prompt's log-probs go to the tokenizer with the request's first output (output_streamer.py)
            "input_logprobs": r.input_lp if sent else None,
            "finish": dict(ABORT_IN_WAITING_QUEUE),
            "spans": version_spans(r.events, self.version, len(r.output_ids)),
            "retractions": r.retractions,
        }

    def pause(self, mode: str) -> None:
        """``Scheduler.pause_generation`` (in_place / retract; abort mode never reaches the scheduler)."""
        assert mode in ("in_place", "retract")
        self.paused = True
        if mode == "in_place":  # everything stays, KV cache included
            return
        retract = [r for r in self.running if r.finish is None]
        self.running = []
        for r in retract:  # release_req + Req.reset_for_retract: KV freed, routes dropped, counted
            r.cache, r.spec_state = None, None  # a speculative state's KV cache with it (its counts stay in r.spec)
            r.routes, r.index = [], []
            r.retractions += 1
            self.waiting.append(r)  # _add_request_to_queue

    def resume(self) -> None:
        """``Scheduler.continue_generation``."""
        self.paused = False

    def record_version(self, new: str | None) -> None:
        """``Scheduler.record_weight_version_change``."""
        if new is None or str(new) == self.version:
            return
        for r in self.live():
            if r.output_ids:
                r.events.append((self.version, len(r.output_ids)))
        self.version = str(new)

    # -- one iteration ---------------------------------------------------------------------------
    def step(self, forward: Callable, speculative: Any = None) -> list[dict]:
        """One scheduler iteration; returns the requests that finished in it. ``speculative``: with
        ``--speculative-algorithm``, what runs a request's prefill (``speculative_start(r, greedy)``) and one
        decode cycle (``speculative_cycle(r, greedy)``: draft, verify, accept; ``stepping.SchedulingOps``)."""
        if self.paused:
            return []
        done: list[LiveReq] = []
        room = len(self.waiting) if self.max_running is None else self.max_running - len(self.running)
        if self.waiting and room > 0:
            batch, self.waiting = self.waiting[:room], self.waiting[room:]
            greedy = all(r.req.top_k <= 1 for r in batch)
            # sglang's ScheduleBatch.is_prefill_only: every request max_new_tokens 0, no speculation
            prefill_only = speculative is None and all(r.req.max_new_tokens == 0 for r in batch)
            for r in batch:
                if r.req.logprob is not None and r.req.logprob.death is not None:
                    raise SchedulerDeath(r.req.logprob.death)  # prompt_logprobs.resolve
                if r.req.max_new_tokens == 0:
                    self._prefill_zero(r, forward, greedy, prefill_only)
                elif speculative is not None:
                    if self._wants_input(r):  # the prompt's log-probs by the target, then the decoder
                        self._prefill(r, forward)
                        r.cache, r.routes, r.index = None, [], []
                    speculative.speculative_start(r, greedy)
                else:
                    self._append(r, self._prefill(r, forward), greedy)
                (done if r.finish is not None else self.running).append(r)
            return [self._result(r) for r in done]
        greedy = all(r.req.top_k <= 1 for r in self.running)
        still: list[LiveReq] = []
        for r in self.running:
            if r.spec_state is not None:
                speculative.speculative_cycle(r, greedy)
            else:
                n = len(r.req.input_ids) + len(r.output_ids)
                self._append(r, forward(r, [r.output_ids[-1]], n - 1)[-1], greedy)
            (done if r.finish is not None else still).append(r)
        self.running = still
        return [self._result(r) for r in done]

    @staticmethod
    def _wants_input(r: LiveReq) -> bool:
        ask = r.req.logprob
        return ask is not None and r.input_lp is None and ask.start < len(r.req.input_ids)

    def _prefill(self, r: LiveReq, forward: Callable) -> torch.Tensor:
        """One prefill ("extend") over ``prompt + output_ids`` (a retracted request's prefix again, under
        the weights loaded now), with the prompt's log-probs the first time (sglang computes them once:
        ``add_input_logprob_return_values`` returns when they exist). Returns the last position's logits."""
        ids = list(r.req.input_ids) + r.output_ids
        r.cache = None
        want = self._wants_input(r)
        keep = len(ids) - r.req.logprob.start if want and r.req.logprob is not None else 1
        logits = forward(r, ids, 0, keep)
        if r.req.logprob is not None and r.input_lp is None:
            r.input_lp = plp.input_logprobs(logits, r.req.input_ids, r.req.logprob)
        return logits[-1]

    def _prefill_zero(self, r: LiveReq, forward: Callable, greedy: bool, prefill_only: bool) -> None:
        """A ``max_new_tokens`` 0 request: finished by its prefill, no output token (``finished_len`` 0).
        Without ``return_logprob`` nothing of its forward is answered: none is run. Prefill-only: no
        sampling; ``top_logprobs_num`` gives one output top row (``compute_logprobs_only``). Otherwise
        its token is sampled and only its log-prob answered (prompt_logprobs module docstring)."""
        ask = r.req.logprob
        if ask is not None:
            logits = self._prefill(r, forward)
            if not prefill_only:
                self._append(r, logits, greedy)
                r.hidden = r.output_ids.pop()
            elif ask.top > 0:
                r.top = [plp.last_position_top(logits, ask.top, 0.0, clamp=False)]
        r.finish = {"type": "length", "length": 0}

    def _append(self, r: LiveReq, logits: torch.Tensor, greedy: bool) -> None:
        from gspo_megatron.engines.hf_engine import HFRolloutEngine

        q = r.req
        params = SamplingParams(
            temperature=0.0 if greedy else q.temperature,
            top_p=q.top_p,
            top_k=-1 if q.top_k == TOP_K_ALL else q.top_k,
            max_new_tokens=q.max_new_tokens,
        )
        token, logprob = HFRolloutEngine._sample(logits.float().view(1, -1), params, r.generator)
        tok = int(token[0])
        r.output_ids.append(tok)
        r.logprobs.append(float(logprob[0]))
        if q.logprob is not None and q.logprob.top > 0:  # the same distribution as the log-prob
            r.top.append(plp.last_position_top(logits, q.logprob.top, params.temperature))
        update_finish(r, tok in q.stop_ids)

    def _result(self, r: LiveReq) -> dict:
        r.cache, r.spec_state = None, None
        out: dict = {
            "rid": r.rid,
            "output_ids": list(r.output_ids),
            "logprobs": list(r.logprobs),
            "top": list(r.top),
            "input_logprobs": r.input_lp,
            "finish": r.finish,
            "spans": version_spans(r.events, self.version, len(r.output_ids)),
            "retractions": r.retractions,
        }
        if r.spec is not None:
            out["spec"] = r.spec.as_dict()
        if r.hidden is not None:
            out["logprob_ids"] = [r.hidden]
        n = len(r.req.input_ids) + len(r.output_ids) - 1  # sglang's [0, seqlen - 1)
        if r.req.routed_start is not None and r.routes:
            routes = torch.cat(r.routes)[:n].to(torch.int32).numpy()
            out["routed_experts"] = routes[min(r.req.routed_start, len(routes)) :]
        if r.req.indexer and r.index:
            out["indexer_topk"] = torch.cat(r.index)[:n].to(torch.int32).numpy()
        return out


def update_finish(r: LiveReq, stopped: bool) -> None:
    """sglang's ``Req.update_finish_state`` after ``r``'s latest tokens (``stopped``: the last is a stop
    token): ``to_finish`` first, then the stop token, then ``max_new_tokens``."""
    if r.to_finish is not None:
        r.finish, r.to_finish = r.to_finish, None
    elif stopped:
        r.finish = {"type": "stop", "matched": r.output_ids[-1]}
    elif len(r.output_ids) >= r.req.max_new_tokens:
        r.finish = {"type": "length", "length": r.req.max_new_tokens}


def new_live(rid: str, req: Request, lora: str | None, server_generator: torch.Generator) -> LiveReq:
    gen = server_generator if req.seed is None else torch.Generator(device="cpu").manual_seed(req.seed)
    return LiveReq(rid=rid, req=req, lora=lora, generator=gen)


def now() -> float:
    return time.time()
