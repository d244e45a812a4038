"""Remote rewards: one scoring round's samples are POSTed in batches to a reward server (a reward
model, a judge) at ``reward.url``. Rank 0 only.

Request (``Content-Type: application/json``), one per batch of ``reward.batch_size`` items:

    per sample:        {"mode": "single", "items": [{"prompt": str, "response": str, "label": <any JSON>}, ...]}
    reward.group=true: {"mode": "group",  "items": [{"prompt": str, "responses": [str, ...], "label": <any>}, ...]}

Response (HTTP 200, JSON): ``{"rewards": [...]}`` with one entry per item, in order: a number per
sample, or with ``mode: group`` a list of numbers per group (one per response). ``null`` or a
non-number scores 0 and counts as an error; NaN / inf as non-finite. Labels are sent as they are in
the dataset (JSON values); prompts are the raw dataset prompts, responses the decoded responses.

Limits: at most ``reward.max_in_flight`` requests at once; the whole round (every batch, retries
included) must finish within ``reward.timeout_s`` of its start: a request still unanswered then
(a hanging server) fails as a timeout, a batch not yet sent fails as a timeout too. A request that
fails fast (connection refused / reset: a dead server; HTTP 5xx or 429) is retried up to
``reward.retries`` times with exponential backoff (0.1 s, 0.2 s, ...) inside the same deadline; other
HTTP errors (4xx) and malformed answers are not retried. Every failure scores 0 and is counted per
sample like a local reward's (``reward/errors``, ``reward/timeouts``, ``reward/nonfinite``, with
``reward.max_failure_share``), so a server that hangs, errors or dies costs a round at most
``reward.timeout_s`` and the run goes on. A round's requests run in its own threads; a thread left
waiting on a hanging server ends when its socket timeout (the round's remaining time) runs out.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, Sequence

from gspo_megatron.rewards.grouping import as_group_rewards, expand_results, make_calls
from gspo_megatron.rewards.outcomes import as_reward, check_failure_share, tally_results

RETRY_STATUS = (429, 500, 502, 503, 504)


class _Retryable(Exception):
    """A fast failure worth another attempt (dead server, 5xx)."""


def _post(url: str, body: bytes, timeout_s: float) -> Any:
    """One POST; the decoded JSON answer. Raises _Retryable, TimeoutError or ValueError."""
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            data = resp.read()
    except urllib.error.HTTPError as e:
        text = e.read()[:200].decode("utf-8", "replace") if e.fp is not None else ""
        if e.code in RETRY_STATUS:
            raise _Retryable(f"HTTP {e.code} from {url}: {text}") from None
        raise ValueError(f"HTTP {e.code} from {url}: {text}") from None
    except (socket.timeout, TimeoutError) as e:
        raise TimeoutError(f"no answer from {url} within the round's timeout") from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise TimeoutError(f"no answer from {url} within the round's timeout") from e
        raise _Retryable(f"{url}: {e.reason}") from None
    except (ConnectionError, OSError) as e:  # reset / closed mid-answer (a server that died)
        raise _Retryable(f"{url}: {type(e).__name__}: {e}") from None
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"{url} answered invalid JSON ({e.msg})") from None


def parse_answer(answer: Any, calls: Sequence[tuple[str, Any, Any]], group: bool) -> list[tuple[str, Any]]:
    """The server's ``{"rewards": [...]}`` -> (status, value) per call. A malformed answer as a
    whole raises ValueError; a bad single entry is that call's error."""
    if not isinstance(answer, dict) or not isinstance(answer.get("rewards"), list):
        raise ValueError(f"the answer must be a JSON object with a 'rewards' list, got {str(answer)[:80]}")
    values = answer["rewards"]
    if len(values) != len(calls):
        raise ValueError(f"the answer has {len(values)} rewards for {len(calls)} items")
    out: list[tuple[str, Any]] = []
    for value, call in zip(values, calls):
        try:
            out.append(("ok", as_group_rewards(value, len(call[1])) if group else as_reward(value)))
        except TypeError as e:
            out.append(("error", f"server {e}"))
    return out


class RemoteRewardScorer:
    """Scores rounds on the reward server at ``url`` (schema and limits: module docstring). Same
    ``score(prompts, responses, labels, group_size) -> (rewards, stats)`` and ``close()`` as the
    local scorers. ``stats`` adds ``reward/remote_requests`` and ``reward/remote_retries``."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 10.0,
        batch_size: int = 16,
        max_in_flight: int = 4,
        retries: int = 2,
        group: bool = False,
        max_failure_share: float = 1.0,
        backoff_s: float = 0.1,
    ):
        if timeout_s <= 0 or batch_size < 1 or max_in_flight < 1 or retries < 0:
            raise ValueError(
                f"bad remote reward limits: timeout_s={timeout_s}, batch_size={batch_size}, "
                f"max_in_flight={max_in_flight}, retries={retries}"
            )
        self.url, self.timeout_s, self.batch_size = url, timeout_s, batch_size
        self.max_in_flight, self.retries, self.group = max_in_flight, retries, group
        self.max_failure_share, self.backoff_s = max_failure_share, backoff_s
        self.last_error: str | None = None
        self._in_flight = 0
        self.max_seen_in_flight = 0  # the most requests this scorer had open at once
        self._lock = threading.Lock()

    def _request(self, calls: list, deadline: float, counters: dict) -> list[tuple[str, Any]]:
        """One batch: its calls' (status, value), retrying fast failures until ``deadline``."""
        if self.group:
            items = [{"prompt": p, "responses": list(r), "label": lab} for p, r, lab in calls]
        else:
            items = [{"prompt": p, "response": r, "label": lab} for p, r, lab in calls]
        try:
            body = json.dumps({"mode": "group" if self.group else "single", "items": items}).encode()
        except (TypeError, ValueError) as e:
            return [("error", f"cannot send the batch as JSON: {e}")] * len(calls)
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return [
                    ("timeout", f"reward server {self.url} gave no answer within reward.timeout_s={self.timeout_s:g}s")
                ] * len(calls)
            with self._lock:
                self._in_flight += 1
                self.max_seen_in_flight = max(self.max_seen_in_flight, self._in_flight)
                counters["requests"] += 1
            try:
                return parse_answer(_post(self.url, body, left), calls, self.group)
            except TimeoutError:
                return [
                    ("timeout", f"reward server {self.url} gave no answer within reward.timeout_s={self.timeout_s:g}s")
                ] * len(calls)
            except ValueError as e:
                return [("error", str(e))] * len(calls)
            except _Retryable as e:
                if attempt >= self.retries:
                    return [("error", f"{e} (after {attempt + 1} attempts)")] * len(calls)
                attempt += 1
                with self._lock:
                    counters["retries"] += 1
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), max(0.0, deadline - time.monotonic())))
            finally:
                with self._lock:
                    self._in_flight -= 1

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any], group_size: int = 1
    ) -> tuple[list[float], dict[str, float]]:
        """One round: never longer than about ``timeout_s`` however the server behaves."""
        calls = make_calls(prompts, responses, labels, group_size, self.group)
        deadline = time.monotonic() + self.timeout_s
        batches = [calls[i : i + self.batch_size] for i in range(0, len(calls), self.batch_size)]
        counters = {"requests": 0, "retries": 0}
        pool = ThreadPoolExecutor(max_workers=self.max_in_flight, thread_name_prefix="gspo-remote-reward")
        futures = [pool.submit(self._request, b, deadline, counters) for b in batches]
        done, _ = wait_futures(futures, timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        pool.shutdown(wait=False, cancel_futures=True)  # a thread stuck on a hanging server ends by its socket timeout
        results: list[tuple[str, Any]] = []
        for f, b in zip(futures, batches):
            if f in done and not f.cancelled():
                results.extend(f.result())
            else:
                results.extend(
                    [
                        (
                            "timeout",
                            f"reward server {self.url} gave no answer within reward.timeout_s={self.timeout_s:g}s",
                        )
                    ]
                    * len(b)
                )
        per_sample = expand_results(results, group_size, self.group)
        rewards, stats, last_error = tally_results(per_sample, self.url)
        self.last_error = last_error or self.last_error
        check_failure_share(self.url, stats, len(per_sample), last_error, self.max_failure_share, field="reward.url")
        stats["reward/remote_requests"] = float(counters["requests"])
        stats["reward/remote_retries"] = float(counters["retries"])
        return rewards, stats

    def close(self) -> None:
        pass
