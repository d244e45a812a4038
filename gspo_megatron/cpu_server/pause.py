"""The front's half of generation, pause and weight-update locking (a mixin of ``http_front.Front``),
as sglang 0.5.23's tokenizer manager does it (``srt/managers/tokenizer_manager.py``,
``tokenizer_control_mixin.py``) over the scheduler of ``scheduler.py`` / ``stepping.py``.

- ``/generate`` (``TokenizerManager.generate_request``): waits while paused (``is_pause_cond``), then
  holds the reader side of ``model_update_lock`` until its answer; the request is queued on TP rank 0
  and a driver thread runs scheduler iterations (``step`` commands) while requests are live and the
  engine is not paused.
- ``/pause_generation`` (``TokenizerManager.pause_generation``, ``Scheduler.pause_generation``):
  ``mode="abort"`` (default): sets the pause, then repeats ``abort_request(abort_all=True)`` every
  1.0 s until no ``/generate`` holds the lock; the scheduler itself is not paused. A waiting request
  answers ``finish_reason {"type": "abort", "message": "Abort in waiting queue"}`` with the tokens the
  tokenizer had (every ``SGLANG_FORCE_STREAM_INTERVAL``); a running one gets ``FINISH_ABORT()``, runs
  one more decode forward (its token is in the answer) and answers ``{"type": "abort", "message":
  "Aborted", "status_code": null, "err_type": null}``, HTTP 200 with its partial output.
  ``"in_place"``: the engine stops; requests keep their KV cache. ``"retract"``: running requests go
  back to the waiting queue without KV (``num_retractions`` + 1) and are prefilled again, under the
  weights then loaded, after ``/continue_generation``. A mode outside the Literal: FastAPI's 422.
- weight updates (``update_weights_from_tensor`` / ``_distributed``, ``begin`` / ``end_weight_update``):
  while paused (any mode) they run at once, holding ``is_pause_cond``; otherwise they take the writer
  side of ``model_update_lock``, i.e. wait until every ``/generate`` in flight has answered, and hold
  back new ones meanwhile (sglang's RWLock prefers writers). ``abort_all_requests`` aborts first.
  ``flush_cache`` (default True) fails the call after the load when requests run or, not paused, wait
  (``stepping.FLUSH_REFUSED_AFTER_UPDATE``); the scheduler's version changed all the same, the
  tokenizer's (``/get_model_info``) only on success.
- ``/flush_cache``: 400 ``Flush cache failed.`` while requests run (``in_place``) or wait unpaused.
- ``/release_memory_occupation`` with requests running: sglang's scheduler dies of its assertion; so
  does the CPU server (``stepping.check_idle_for_release``).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable

from gspo_megatron.cpu_server.prompt_logprobs import add_logprob_meta
from gspo_megatron.cpu_server.request_checks import literal_refusal
from gspo_megatron.cpu_server.scheduler import PAUSE_MODES, add_weight_versions_to_meta_info

ABORT_POLL_S = 1.0  # tokenizer_manager.py pause_generation: asyncio.sleep(1.0) between abort rounds
#: test-only (not sglang's): seconds the driver sleeps after each scheduler iteration, so that a test
#: can pause a request within a known number of tokens on a loaded machine
STEP_SLEEP_ENV = "GSPO_CPU_SERVER_STEP_SLEEP_S"


class WorkerDied(RuntimeError):
    """TP rank 0 closed its pipe (raised by the front's ``command``)."""


class RWLock:
    """sglang's ``utils/aio_rwlock.RWLock`` with threads: readers wait while a writer is active or
    waiting (writers first); a writer waits for the readers to leave."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    def locked(self) -> bool:
        with self._cond:
            return self._readers > 0 or self._writer

    def acquire_read(self, timeout: float | None = None) -> bool:
        with self._cond:
            ok = self._cond.wait_for(lambda: not self._writer and self._waiting_writers == 0, timeout)
            if ok:
                self._readers += 1
            return ok

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextmanager
    def write(self):
        with self._cond:
            self._waiting_writers += 1
            try:
                self._cond.wait_for(lambda: not self._writer and self._readers == 0)
                self._writer = True
            finally:
                self._waiting_writers -= 1
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class _Slot:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.result: dict | None = None
        self.error: str | None = None


def pause_mode_refusal(body: dict) -> tuple[int, dict] | None:
    """FastAPI's 422 for a ``mode`` outside ``Literal["abort", "retract", "in_place"]``."""
    return literal_refusal(body, "mode", PAUSE_MODES)


class PausingFront:
    """Mixin of ``Front``: needs ``command`` (one worker command under the command lock), ``paused`` /
    ``pause_cond`` (the tokenizer manager's ``is_pause`` / ``is_pause_cond``), ``weight_version``."""

    # provided by ``http_front.Front`` (``command`` is its method, the others are set in its ``__init__``)
    command: Callable[..., Any]
    paused: bool
    pause_cond: threading.Condition
    weight_version: str

    def _init_scheduling(self) -> None:
        self.rw = RWLock()  # the tokenizer manager's model_update_lock
        self.slots: dict[str, _Slot] = {}
        self.work = threading.Condition()
        self.live, self.engine_paused, self.closed = 0, False, False
        # commands other than ``step`` waiting for the command lock: the driver waits for them before
        # its next iteration, as sglang's scheduler takes its control requests between two batches
        # (``event_loop_normal``: ``recv_requests`` / ``process_input_requests`` first)
        self.control_waiting = 0
        self.step_sleep = float(os.environ.get(STEP_SLEEP_ENV) or 0.0)
        self.driver = threading.Thread(target=self._drive, daemon=True, name="cpu_server_scheduler")
        self.driver.start()

    # -- results ---------------------------------------------------------------------------------
    def absorb(self, result: dict) -> None:
        """Called under the command lock with every worker answer: queue state and finished requests."""
        if "live" in result:
            with self.work:
                self.live, self.engine_paused = int(result["live"]), bool(result["paused"])
                self.work.notify_all()
        for out in result.get("finished") or []:
            slot = self.slots.pop(out["rid"], None)
            if slot is not None:
                slot.result = out
                slot.event.set()
        for rid, msg in (result.get("failed") or {}).items():
            self._fail(rid, msg)

    def _fail(self, rid: str, msg: str) -> None:
        slot = self.slots.pop(rid, None)
        if slot is not None:
            slot.error = msg
            slot.event.set()

    def _drive(self) -> None:
        """Scheduler iterations while requests are live and the engine is not paused."""
        while True:
            with self.work:
                self.work.wait_for(
                    lambda: self.closed or (self.live > 0 and not self.engine_paused and self.control_waiting == 0)
                )
                if self.closed:
                    return
            if self.step_sleep > 0:
                time.sleep(self.step_sleep)
            try:
                result = self.command("step")
            except WorkerDied as e:
                for rid in list(self.slots):
                    self._fail(rid, str(e))
                return
            if not result["success"]:  # a rank failed the step: its requests fail, the queues empty
                for rid in list(self.slots):
                    self._fail(rid, result.get("message", "step failed"))
                self.command("drop")

    def close_scheduling(self) -> None:
        with self.work:
            self.closed = True
            self.work.notify_all()

    # -- /generate -------------------------------------------------------------------------------
    def run_requests(self, requests: list[dict], read_timeout: float | None = None) -> tuple[int, Any]:
        """Queue ``requests`` under the reader lock and wait for every answer. (status, results|error)."""
        if not self.rw.acquire_read(read_timeout):
            return 503, ""
        try:
            rids = [uuid.uuid4().hex for _ in requests]
            slots = [_Slot() for _ in rids]
            self.slots.update(zip(rids, slots))
            result = self.command("submit", requests=requests, rids=rids)
            if not result["success"]:
                for rid in rids:
                    self.slots.pop(rid, None)
                return 400, {"error": {"message": result["message"]}}
            for s in slots:
                s.event.wait()
            errors = [s.error for s in slots if s.error is not None]
            if errors:
                return 400, {"error": {"message": errors[0]}}
            return 200, [s.result for s in slots]
        finally:
            self.rw.release_read()

    def meta_info(
        self,
        out: dict,
        prompt_len: int,
        logprob: bool,
        rid: str,
        t0: float,
        top_logprobs_num: int = 0,
        decode: Callable[[Any], list] | None = None,
    ) -> dict:
        """sglang's meta_info of one answer: ``_handle_batch_output`` for a finished request (an aborted
        running one included), ``_handle_abort_req`` for one aborted in the waiting queue. The log-prob
        fields: ``prompt_logprobs.add_logprob_meta`` (``decode``: the entries' texts, None each)."""
        n = len(out["output_ids"])
        if out.get("waiting_abort"):
            meta: dict = {"id": rid, "finish_reason": out["finish"], "weight_version": self.weight_version}
        else:
            meta = {
                "id": rid,
                "finish_reason": out["finish"],
                "prompt_tokens": prompt_len,
                "weight_version": self.weight_version,
                "num_retractions": out.get("retractions", 0),
            }
        if logprob:
            add_logprob_meta(meta, out, top_logprobs_num, decode or (lambda ids: [None] * len(ids)))
        meta["completion_tokens"] = n
        if not out.get("waiting_abort"):
            meta["cached_tokens"] = 0
        add_weight_versions_to_meta_info(meta, out["spans"], n)
        meta["e2e_latency"] = time.time() - t0
        return meta

    def requests_report(self, body: dict) -> tuple[int, Any]:
        """Test-only ``GET /cpu_server/requests``: the scheduler's live requests (``op_report``)."""
        result = self.command("report")
        return 200, {"paused": result["paused"], "requests": result["requests"]}

    # -- pause / continue ------------------------------------------------------------------------
    def pause_generation(self, body: dict) -> tuple[int, Any]:
        refusal = pause_mode_refusal(body)
        if refusal is not None:
            return refusal
        mode = body.get("mode", "abort")
        with self.pause_cond:
            self.paused = True
            if mode != "abort":
                self.command("pause", mode=mode)
            else:
                while True:
                    self.command("abort_all")
                    if not self.rw.locked():
                        break
                    time.sleep(ABORT_POLL_S)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> tuple[int, Any]:
        with self.pause_cond:  # torch_empty_cache: nothing to empty on CPU
            self.paused = False
            self.command("continue")
            self.pause_cond.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    # -- weight updates: model_update_lock -------------------------------------------------------
    def locked_update(self, fn, body: dict | None = None):
        """``fn()`` as sglang's tokenizer manager runs an update: ``abort_all_requests`` first; paused:
        at once, holding ``is_pause_cond``; else under the writer lock."""
        if body is not None and body.get("abort_all_requests"):
            self.command("abort_all")
        with self.pause_cond:
            if self.paused:
                return fn()
        with self.rw.write():
            return fn()
