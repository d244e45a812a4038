"""Scoring calls for per-sample and group rewards, and their results mapped back to samples.

A scoring round is a flat, group-contiguous list of n samples (prompt, response, label): samples
``[g*G, (g+1)*G)`` are the G responses to one prompt (``group_size`` G; the rollout's group size, or
``eval.n`` in evaluation). A reward is called once per sample (``fn(prompt, response, label) ->
float``), or with ``reward.group`` once per group (``fn(prompt, [response_1..response_G], label) ->
[r_1..r_G]``). Failures are always counted per sample: a group call that fails costs its G samples.
Used on global rank 0 by every scorer (inline, worker pool, remote).
"""

from __future__ import annotations

from typing import Any, Sequence

from gspo_megatron.rewards.outcomes import as_reward


def as_group_rewards(value: Any, size: int) -> list[float]:
    """A group reward's return value as ``size`` floats; TypeError naming what came back otherwise."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise TypeError(f"returned {type(value).__name__} {value!r:.40}, expected a list of {size} numbers")
    values = list(value)
    if len(values) != size:
        raise TypeError(f"returned {len(values)} values for a group of {size} responses")
    return [as_reward(v) for v in values]


def make_calls(
    prompts: Sequence[str], responses: Sequence[str], labels: Sequence[Any], group_size: int, group: bool
) -> list[tuple[str, Any, Any]]:
    """The calls of one round: (prompt, response, label) per sample, or with ``group`` (prompt,
    [G responses], label) per group. ValueError when the lists differ in length, n is not a multiple
    of ``group_size``, or a group's prompts differ (the rows are not group-contiguous)."""
    if not len(prompts) == len(responses) == len(labels):
        raise ValueError(
            f"prompts, responses and labels differ in length: {len(prompts)}, {len(responses)}, {len(labels)}"
        )
    if not group:
        return list(zip(prompts, responses, labels))
    n, G = len(prompts), group_size
    if G < 1 or n % G:
        raise ValueError(f"{n} samples cannot be cut into groups of {G}")
    calls = []
    for start in range(0, n, G):
        if any(p != prompts[start] for p in prompts[start : start + G]):
            raise ValueError(f"samples {start}..{start + G - 1} are not one prompt's group")
        calls.append((prompts[start], list(responses[start : start + G]), labels[start]))
    return calls


def expand_results(results: Sequence[tuple[str, Any]], group_size: int, group: bool) -> list[tuple[str, Any]]:
    """Per-call (status, value) -> per-sample (status, value): a group's "ok" list is spread over its
    samples; any other status repeats for each of its G samples."""
    if not group:
        return list(results)
    out: list[tuple[str, Any]] = []
    for status, value in results:
        if status == "ok":
            out.extend(("ok", v) for v in value)
        else:
            out.extend([(status, value)] * group_size)
    return out


def call_reward(fn, call: tuple[str, Any, Any], group: bool) -> Any:
    """Call ``fn`` on one call's (prompt, response(s), label); a float, or a list of floats for a group."""
    prompt, response, label = call
    value = fn(prompt, response, label)
    return as_group_rewards(value, len(response)) if group else as_reward(value)
