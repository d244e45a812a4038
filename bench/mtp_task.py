"""The reward of bench/mtp_draft.py's task (``reward.function=bench/mtp_task.py:near_digit``, prompts of the
built-in ``last_digit`` task): how close each of the response's first ``LENGTH`` characters is to the prompt
number's last digit, by code point: 1 for the digit itself, falling linearly to 0 at ``WIDTH`` code points
away, averaged over ``LENGTH`` positions (a missing position scores 0).

Why this reward: the bench's starting policy is a sharpened random model whose samples are peaked cycles of
a few bytes (for seed 0 mostly ``\\x15``, ``\\x16``, ``9``, ``I``, ``o``, ``z``), far from any digit but not all
equally far, so the reward is dense from the first step (every sample scores something, samples differ) and
its optimum (the digit, repeated) is far from where the policy starts: the policy has far to move, which is
what the draft has to follow."""

from __future__ import annotations

LENGTH = 12
WIDTH = 64


def near_digit(prompt: str, response: str, label: object) -> float:
    """Mean over ``response[:LENGTH]`` (padded to ``LENGTH`` with zeros) of ``max(0, 1 - |ord(ch) -
    ord(label)| / WIDTH)``, in [0, 1]."""
    target = ord(str(label)[0])
    head = response[:LENGTH]
    return sum(max(0.0, 1.0 - abs(ord(ch) - target) / WIDTH) for ch in head) / LENGTH
