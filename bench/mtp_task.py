"""The reward of bench/mtp_draft.py's task (``reward.function=bench/mtp_task.py:repeat_digit``, prompts of
the built-in ``last_digit`` task): the share of the response's first ``LENGTH`` characters equal to the
prompt number's last digit. Responses are long (``LENGTH`` tokens of the byte-level demo tokenizer) and
the policy moves far from its random start (towards repeating one digit), so a draft fitted to the
starting policy goes stale while a draft trained along with the policy can follow it."""

from __future__ import annotations

LENGTH = 12


def repeat_digit(prompt: str, response: str, label: object) -> float:
    """Share of ``response[:LENGTH]`` equal to ``label`` (one digit), in [0, 1]."""
    digit = str(label)
    head = response[:LENGTH]
    return sum(ch == digit for ch in head) / LENGTH
