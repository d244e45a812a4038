"""The shaped partial-credit reward for an integer answer, shared by the built-in tasks
(:mod:`gspo_megatron.data.tasks`) and the tool-calling example (:mod:`gspo_megatron.data.tool_calc`)."""

from __future__ import annotations

# Reward scale of the shaped integer reward (sums to 1.0 for a clean, correct answer). Correctness
# of the leading characters dominates: it is symmetric across answers, whereas a large format credit
# makes a random-init policy collapse onto one digit string (measured with bench/demo_task_sanity.py).
FORMAT_CREDIT = 0.1  # the response starts with a digit
CLEAN_CREDIT = 0.1  # the response is only digits, as many as the label (it stopped in time)
CORRECT_CREDIT = 0.8  # the response starts with the label


def _ascii_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()  # str.isdigit alone accepts "²", "٣", ...


def shaped_integer_reward(response: str, label: str) -> float:
    """Partial-credit reward in [0, 1] for an integer answer (surrounding whitespace ignored)::

        0.1 * [starts with a digit] + 0.1 * [only digits, len == len(label)] + 0.8 * [starts with label]

    Label "1": "1" -> 1.0; "1x" or "11" -> 0.9; "7" -> 0.2; "77" or "7x" -> 0.1; "x" -> 0.0.
    The response must be decoded *without* dropping special tokens other than the final stop token
    (see :func:`gspo_megatron.data.dataset.decode_response`), so stray specials cost the clean credit.
    """
    text, target = response.strip(), str(label).strip()
    if not _ascii_digits(text[:1]):
        return 0.0
    reward = FORMAT_CREDIT
    if _ascii_digits(text) and len(text) == len(target):
        reward += CLEAN_CREDIT
    if target and text.startswith(target):
        reward += CORRECT_CREDIT
    return reward
