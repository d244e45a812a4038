"""Built-in tasks with verifiable rewards, generated from a seed (no files needed).

Each task yields rows ``{"prompt": str, "label": str}`` and scores a decoded response with
``reward(prompt, response, label) -> float`` in [0, 1] (shaped, see :func:`shaped_integer_reward`).

- ``last_digit`` (the CPU demo): "last digit of 4821?" -> "1". A copy from a fixed offset of the
  prompt, learnable by GSPO from a randomly initialized tiny model with the byte tokenizer.
- ``add_digits`` (harder): "3+5=" -> "8" (single-digit operands, answers 0..18).
- ``tool_calc`` (multi-turn, with a calculator tool): "7*8=?" -> "56"; its rollout hook is
  ``gspo_megatron.data.tool_calc:tool_calc_rollout`` (see that module); the reward here scores a
  plain single-turn answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from gspo_megatron.data.answer_reward import shaped_integer_reward


@dataclass(frozen=True)
class Task:
    """A generated task. ``make_row(rng)`` draws one row; ``reward`` scores a response."""

    name: str
    description: str
    make_row: Callable[[random.Random], dict]
    reward: Callable[[str, str, object], float]
    max_new_tokens: int  # enough for the answer and the end-of-sequence token

    def rows(self, num_rows: int, seed: int) -> list[dict]:
        """``num_rows`` rows, a deterministic function of ``seed``."""
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        rng = random.Random(f"{self.name}:{seed}")
        return [self.make_row(rng) for _ in range(num_rows)]


def _last_digit_row(rng: random.Random) -> dict:
    number = rng.randint(10, 99999)
    return {"prompt": f"last digit of {number}?", "label": str(number % 10)}


def _add_digits_row(rng: random.Random) -> dict:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"prompt": f"{a}+{b}=", "label": str(a + b)}


def _task_reward(prompt: str, response: str, label: object) -> float:
    return shaped_integer_reward(response, str(label))


TASKS: dict[str, Task] = {
    "last_digit": Task(
        name="last_digit",
        description="copy the last digit of a 2-5 digit number; shaped reward in [0, 1]",
        make_row=_last_digit_row,
        reward=_task_reward,
        max_new_tokens=4,
    ),
    "add_digits": Task(
        name="add_digits",
        description="add two single digits (answer 0..18); shaped reward in [0, 1]",
        make_row=_add_digits_row,
        reward=_task_reward,
        max_new_tokens=6,
    ),
    "tool_calc": Task(
        name="tool_calc",
        description="7*8=? with a calculator tool (rollout.custom_function "
        "gspo_megatron.data.tool_calc:tool_calc_rollout); reward in [0, 1]",
        make_row=lambda rng: _tool_calc().make_row(rng),
        reward=lambda prompt, response, label: _tool_calc().single_turn_reward(prompt, response, label),
        max_new_tokens=4,
    ),
}


def _tool_calc():
    from gspo_megatron.data import tool_calc

    return tool_calc


def get_task(name: str) -> Task:
    """Look up a built-in task by name."""
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; built-in tasks: {sorted(TASKS)}")
    return TASKS[name]
