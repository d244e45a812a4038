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

import logging
import math
import multiprocessing as mp
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Sequence

from gspo_megatron.errors import UserInputError
from gspo_megatron.runtime.children import run_dying_with_parent

logger = logging.getLogger(__name__)


class RewardFailure(UserInputError):
    """Too many calls of one scoring round failed; names the reward spec and the last error."""


def as_reward(value: Any) -> float:
    """A reward function's return value as a float; TypeError naming the value when it is not a number."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"returned {type(value).__name__} {value!r:.40}, expected a number")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"returned {type(value).__name__} {value!r:.40}, expected a number") from None


def check_failure_share(spec: str, stats: dict[str, float], n: int, last_error: str | None,
                        max_failure_share: float) -> None:
    """Raise RewardFailure when (errors + timeouts + non-finite) / n >= max_failure_share."""
    failed = stats["reward/errors"] + stats["reward/timeouts"] + stats["reward/nonfinite"]
    if n and failed / n >= max_failure_share:
        raise RewardFailure(
            f"reward.function {spec!r} failed on {int(failed)} of {n} calls in one scoring round "
            f"(reward.max_failure_share={max_failure_share:g}); last error: {last_error}")


def _worker_main(conn: Connection, spec: str) -> None:
    """Worker loop: load the reward fn, then answer (index, prompt, response, label) requests."""
    try:
        from gspo_megatron.rewards.registry import get_reward_fn

        fn = get_reward_fn(spec)
    except BaseException:
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
            value = as_reward(fn(prompt, response, label))
            conn.send((index, "ok", value))
        except BaseException as e:  # the user's code may raise anything, even SystemExit
            conn.send((index, "error", f"{type(e).__name__}: {e}"))


def tally_results(results: Sequence[tuple[str, Any]], spec: str) -> tuple[list[float], dict[str, float], str | None]:
    """(status, value) per call, status "ok" / "error" / "timeout" -> (rewards with 0.0 for every
    failure or non-finite value, counts reward/errors, reward/timeouts, reward/nonfinite, the last
    failure's text). Logs a warning when calls failed."""
    rewards: list[float] = []
    stats = {"reward/errors": 0, "reward/timeouts": 0, "reward/nonfinite": 0}
    last_error = None
    for status, value in results:
        if status == "ok" and math.isfinite(value):
            rewards.append(value)
            continue
        rewards.append(0.0)
        if status == "ok":
            stats["reward/nonfinite"] += 1
            last_error = f"returned {value}"
        else:
            stats["reward/timeouts" if status == "timeout" else "reward/errors"] += 1
            last_error = value
    if stats["reward/errors"] or stats["reward/timeouts"] or stats["reward/nonfinite"]:
        logger.warning("reward %r: %s (last: %s)", spec, stats, last_error)
    return rewards, {k: float(v) for k, v in stats.items()}, last_error


class InlineRewardScorer:
    """``reward.num_workers=0``: scores in the calling process, for fast trusted rewards. Same
    interface and failure accounting as RewardRunner, but no isolation and no timeout."""

    def __init__(self, spec: str, max_failure_share: float = 1.0):
        from gspo_megatron.rewards.registry import get_reward_fn

        self.spec, self.fn, self.last_error = spec, get_reward_fn(spec), None
        self.max_failure_share = max_failure_share

    def score(self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any]
              ) -> tuple[list[float], dict[str, float]]:
        results: list[tuple[str, Any]] = []
        for p, r, lab in zip(prompts, responses, labels):
            try:
                results.append(("ok", as_reward(self.fn(p, r, lab))))
            except Exception as e:  # noqa: BLE001 - a failing reward scores 0 and is counted
                results.append(("error", f"{type(e).__name__}: {e}"))
        rewards, stats, last_error = tally_results(results, self.spec)
        self.last_error = last_error or self.last_error
        check_failure_share(self.spec, stats, len(results), last_error, self.max_failure_share)
        return rewards, stats

    def close(self) -> None:
        pass


class _Worker:
    def __init__(self, ctx, spec: str):
        self.conn, child_conn = ctx.Pipe(duplex=True)
        # the worker dies with the trainer, also when the trainer is SIGKILLed
        self.proc = ctx.Process(target=run_dying_with_parent, args=(_worker_main, child_conn, spec), daemon=True)
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

    def __init__(self, spec: str, num_workers: int = 2, timeout_s: float = 10.0, start_timeout_s: float = 120.0,
                 max_failure_share: float = 1.0):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.spec, self.timeout_s, self.start_timeout_s = spec, timeout_s, start_timeout_s
        self.max_failure_share = max_failure_share
        self._ctx = mp.get_context("spawn")
        self._workers = [_Worker(self._ctx, spec) for _ in range(num_workers)]
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
        self._workers[i] = _Worker(self._ctx, self.spec)
        self.restarts += 1

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any]
    ) -> tuple[list[float], dict[str, float]]:
        """Score every (prompt, response, label); never blocks longer than about
        ``timeout_s`` per call beyond the pool's throughput."""
        if not len(prompts) == len(responses) == len(labels):
            raise ValueError(
                f"prompts, responses and labels differ in length: {len(prompts)}, {len(responses)}, {len(labels)}"
            )
        n = len(prompts)
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
                    except Exception as e:  # e.g. an unpicklable label
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
        return self._collect(results, n)

    def _collect(self, results: dict[int, tuple[str, Any]], n: int) -> tuple[list[float], dict[str, float]]:
        rewards, stats, last_error = tally_results([results[i] for i in range(n)], self.spec)
        self.last_error = last_error or self.last_error
        check_failure_share(self.spec, stats, n, last_error, self.max_failure_share)
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
        except Exception:
            pass
