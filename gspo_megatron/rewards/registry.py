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

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable

from gspo_megatron.data.tasks import TASKS
from gspo_megatron.rewards.builtin import exact_match_reward, math_reward

RewardFn = Callable[[str, str, Any], float]

BUILTIN_REWARDS: dict[str, RewardFn] = {"math": math_reward, "exact_match": exact_match_reward}


def load_callable(spec: str) -> Callable:
    """Load ``path/to/file.py:name`` (by path) or ``package.module:name`` (by import)."""
    if ":" not in spec:
        raise ValueError(f"callable spec {spec!r} must look like 'path/to/file.py:fn' or 'package.module:fn'")
    target, attr = spec.rsplit(":", 1)
    if not attr.isidentifier():
        raise ValueError(f"callable spec {spec!r}: {attr!r} is not a valid function name")
    if target.endswith(".py"):
        path = os.path.abspath(target)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"reward file not found: {target} (from spec {spec!r})")
        # A stable, path-derived module name so pickled references and re-loads agree.
        mod_name = "gspo_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        module = sys.modules.get(mod_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(mod_name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise ImportError(f"cannot load python file {path}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[mod_name] = module
            try:
                loader_spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[mod_name]
                raise
    else:
        module = importlib.import_module(target)
    if not hasattr(module, attr):
        raise AttributeError(f"{target} has no attribute {attr!r} (from spec {spec!r})")
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"{spec!r} is not callable")
    return fn


def get_reward_fn(spec: str) -> RewardFn:
    """Resolve a reward spec (see module docstring) to a function."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    task_name = spec[len("task:"):] if spec.startswith("task:") else spec
    if task_name in TASKS:
        return TASKS[task_name].reward
    if ":" in spec:
        return load_callable(spec)
    raise ValueError(
        f"unknown reward {spec!r}: expected one of {sorted(BUILTIN_REWARDS)}, a task name "
        f"{sorted(TASKS)}, 'path/to/file.py:fn' or 'package.module:fn'"
    )
