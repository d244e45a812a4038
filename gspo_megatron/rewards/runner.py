"""Scores a batch of responses in a persistent pool of worker processes, with a per-call timeout.

Called on global rank 0. Each worker (spawned, so no forked locks or threads) loads the reward
function from its spec *inside the worker* (user files are loaded by path there), then answers one
call at a time. A call that exceeds ``timeout_s`` gets its worker killed and replaced (threads cannot
be killed, processes can), so a hanging reward never blocks the loop. An exception, a worker crash,
a non-numeric or non-finite value, or a timeout scores 0.0 and is counted in the returned stats:
``reward/errors``, ``reward/timeouts``, ``reward/nonfinite``. When at least ``max_failure_share`` of
one ``score()`` call's items fail (default 1.0: all of them), ``score`` raises :class:`RewardFailure`
(a user error: the reward function is broken, training on all-zero rewards would be meaningless).
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from gspo_megatron.rewards.grouping import call_reward, expand_results, make_calls
from gspo_megatron.rewards.outcomes import check_failure_share, tally_results
from gspo_megatron.runtime.children import run_dying_with_parent


def _worker_main(conn: Connection, spec: str, group: bool = False) -> None:
    """Worker loop: load the reward fn, then answer (index, prompt, response(s), label) requests
    (``group``: the response is a list and the answer a list of floats, see rewards/grouping.py)."""
    try:
        from gspo_megatron.rewards.registry import get_reward_fn

        fn = get_reward_fn(spec)
    except BaseException:  # noqa: BLE001 - the user's reward module may raise anything while importing
        conn.send(("load_error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, prompt, response, label = msg
        try:
            conn.send((index, "ok", call_reward(fn, (prompt, response, label), group)))
        except BaseException as e:  # noqa: BLE001 - the user's code may raise anything, even SystemExit
            conn.send((index, "error", f"{type(e).__name__}: {e}"))


class InlineRewardScorer:
    """``reward.num_workers=0``: scores in the calling process, for fast trusted rewards. Same
    interface and failure accounting as RewardRunner, but no isolation and no timeout.
    ``group``: the function scores a prompt's responses together (rewards/grouping.py)."""

    def __init__(self, spec: str, max_failure_share: float = 1.0, group: bool = False):
        from gspo_megatron.rewards.registry import get_reward_fn

        self.spec, self.fn = spec, get_reward_fn(spec)
        self.last_error: str | None = None
        self.max_failure_share, self.group = max_failure_share, group

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any], group_size: int = 1
    ) -> tuple[list[float], dict[str, float]]:
        """Rewards of n group-contiguous samples (``group_size`` responses per prompt; used with
        ``group``) and the failure counts."""
        results: list[tuple[str, Any]] = []
        for call in make_calls(prompts, responses, labels, group_size, self.group):
            try:
                results.append(("ok", call_reward(self.fn, call, self.group)))
            except Exception as e:  # noqa: BLE001 - a failing reward scores 0 and is counted
                results.append(("error", f"{type(e).__name__}: {e}"))
        results = expand_results(results, group_size, self.group)
        rewards, stats, last_error = tally_results(results, self.spec)
        self.last_error = last_error or self.last_error
        check_failure_share(self.spec, stats, len(results), last_error, self.max_failure_share)
        return rewards, stats

    def close(self) -> None:
        pass


class _Worker:
    def __init__(self, ctx, spec: str, group: bool = False):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        # the worker dies with the trainer, also when the trainer is SIGKILLed
        self.proc = ctx.Process(target=run_dying_with_parent, args=(_worker_main, child_conn, spec, group), daemon=True)
        self.proc.start()
        child_conn.close()
        self.ready = False
        self.started_at = time.monotonic()
        self.task: int | None = None  # index of the item being scored
        self.deadline = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardRunner:
    """A persistent pool of ``num_workers`` reward processes for one reward spec.

    ``score(prompts, responses, labels) -> (rewards, stats)``; rewards are floats (0.0 for a failed
    call). The constructor waits until every worker has loaded the function (a bad spec raises here,
    with the worker's traceback). Use as a context manager or call ``close()``.
    """

    def __init__(
        self,
        spec: str,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        start_timeout_s: float = 120.0,
        max_failure_share: float = 1.0,
        group: bool = False,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.spec, self.timeout_s, self.start_timeout_s = spec, timeout_s, start_timeout_s
        self.max_failure_share, self.group = max_failure_share, group
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, spec, group) for _ in range(num_workers)]
        self.restarts = 0
        self.last_error: str | None = None
        for w in self._workers:
            self._await_ready(w, time.monotonic() + start_timeout_s)

    def _await_ready(self, w: _Worker, deadline: float) -> None:
        """Block until ``w`` reports it loaded the reward fn (raises on a load error / crash)."""
        while not w.ready:
            ready = wait([w.conn, w.proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            if w.conn in ready and self._on_message(w, None):
                continue
            if w.conn in ready or w.proc.sentinel in ready or time.monotonic() >= deadline:
                code = w.proc.exitcode
                w.kill()
                self.close()
                raise RuntimeError(f"reward worker for {self.spec!r} failed to start (exit code {code})")

    def _on_message(self, w: _Worker, results) -> bool:
        """Handle one message from ``w``; False when its pipe is closed (the worker died)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            return False
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "load_error":
            w.kill()
            self.close()
            raise RuntimeError(f"reward worker could not load reward {self.spec!r}:\n{msg[1]}")
        else:
            index, status, value = msg
            if results is not None and index == w.task:
                results[index] = (status, value)
                w.task = None
        return True

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = _Worker(self._ctx, self.spec, self.group)
        self.restarts += 1

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any], group_size: int = 1
    ) -> tuple[list[float], dict[str, float]]:
        """Score every (prompt, response, label) (with ``group``: every group of ``group_size``
        consecutive samples in one call); never blocks longer than about ``timeout_s`` per call
        beyond the pool's throughput."""
        calls = make_calls(prompts, responses, labels, group_size, self.group)
        prompts = [c[0] for c in calls]
        responses = [c[1] for c in calls]
        labels = [c[2] for c in calls]
        n = len(calls)
        results: dict[int, tuple[str, Any]] = {}
        pending = list(range(n - 1, -1, -1))  # a stack, popped from the end
        while len(results) < n:
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.ready and w.task is None and pending:
                    if not w.proc.is_alive():  # died while idle (e.g. killed from outside)
                        self._replace(i)
                        continue
                    idx = pending.pop()
                    try:
                        w.conn.send((idx, prompts[idx], responses[idx], labels[idx]))
                    except (BrokenPipeError, OSError):
                        results[idx] = ("error", "reward worker died")
                        self._replace(i)
                        continue
                    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable label
                        results[idx] = ("error", f"cannot send item {idx} to the worker: {e}")
                        continue
                    w.task, w.deadline = idx, now + self.timeout_s
            busy = [w for w in self._workers if w.task is not None]
            starting = [w for w in self._workers if not w.ready]
            if not busy and not starting:
                continue
            deadlines = [w.deadline for w in busy] + [w.started_at + self.start_timeout_s for w in starting]
            handles = [w.conn for w in busy + starting] + [w.proc.sentinel for w in busy + starting]
            ready = set(wait(handles, timeout=max(0.0, min(deadlines) - time.monotonic())))
            now = time.monotonic()
            for i, w in enumerate(list(self._workers)):
                alive = True
                if w.conn in ready:
                    alive = self._on_message(w, results)
                    if alive and w.conn.poll():  # drain a second message that arrived with the first
                        continue
                # A closed pipe also "polls" readable: a dead worker is one whose pipe hit EOF, or
                # whose process ended with nothing left to read.
                dead = not alive or (w.proc.sentinel in ready and not w.conn.poll())
                if w.task is not None and dead:
                    w.proc.join(timeout=1)
                    results[w.task] = ("error", f"reward worker crashed (exit code {w.proc.exitcode})")
                    self._replace(i)
                elif w.task is not None and now >= w.deadline and not w.conn.poll():
                    results[w.task] = ("timeout", f"reward call timed out after {self.timeout_s}s")
                    self._replace(i)
                elif not w.ready and (dead or now >= w.started_at + self.start_timeout_s):
                    self.close()
                    raise RuntimeError(f"a replacement reward worker for {self.spec!r} failed to start")
        per_sample = expand_results([results[i] for i in range(n)], group_size, self.group)
        rewards, stats, last_error = tally_results(per_sample, self.spec)
        self.last_error = last_error or self.last_error
        check_failure_share(self.spec, stats, len(per_sample), last_error, self.max_failure_share)
        return rewards, stats

    def close(self) -> None:
        """Stop every worker (politely, then by force)."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2)
            w.kill()
        self._workers = []

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass
