"""What one scoring round's calls returned, counted the same way by every scorer (inline, worker
pool, remote): a failed call (an exception, a crash, a timeout, an HTTP error) or a non-finite value
scores 0.0 and is counted per sample in ``reward/errors``, ``reward/timeouts``, ``reward/nonfinite``;
when at least ``reward.max_failure_share`` of the round's samples failed, :class:`RewardFailure`
stops the run. Rank 0 only.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Sequence

from gspo_megatron.errors import UserInputError

logger = logging.getLogger("gspo_megatron.rewards")


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


def check_failure_share(
    spec: str,
    stats: dict[str, float],
    n: int,
    last_error: str | None,
    max_failure_share: float,
    field: str = "reward.function",
) -> None:
    """Raise RewardFailure when (errors + timeouts + non-finite) / n >= max_failure_share; the
    message names ``field`` (reward.function, or reward.url for a server) and ``spec``."""
    failed = stats["reward/errors"] + stats["reward/timeouts"] + stats["reward/nonfinite"]
    if n and failed / n >= max_failure_share:
        raise RewardFailure(
            f"{field} {spec!r} failed on {int(failed)} of {n} calls in one scoring round "
            f"(reward.max_failure_share={max_failure_share:g}); last error: {last_error}"
        )


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
