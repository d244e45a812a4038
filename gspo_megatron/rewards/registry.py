"""Reward function lookup by spec string.

Specs:
- ``math``                    math-verify equivalence (needs the math-verify package)
- ``exact_match``             normalized string equality
- ``last_digit`` / ``task:last_digit`` (any built-in task name): the task's shaped reward
- ``path/to/file.py:fn``      a user function loaded from a file
- ``package.module:fn``       a user function from an importable module

Every reward is called as ``fn(prompt: str, response: str, label) -> float``.
"""

from __future__ import annotations

from typing import Any, Callable

from gspo_megatron.data.tasks import TASKS
from gspo_megatron.rewards.builtin import BUILTIN_REWARDS
from gspo_megatron.user_code import load_callable

RewardFn = Callable[[str, str, Any], float]


def get_reward_fn(spec: str) -> RewardFn:
    """Resolve a reward spec (see module docstring) to a function."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    task_name = spec[len("task:") :] if spec.startswith("task:") else spec
    if task_name in TASKS:
        return TASKS[task_name].reward
    if ":" in spec:
        return load_callable(spec)
    raise ValueError(
        f"unknown reward {spec!r}: expected one of {sorted(BUILTIN_REWARDS)}, a task name "
        f"{sorted(TASKS)}, 'path/to/file.py:fn' or 'package.module:fn'"
    )
