"""Built-in reward functions, each ``fn(prompt: str, response: str, label) -> float``.

- ``math_reward``: 1.0 when math-verify finds the response's final answer equal to the label.
- ``exact_match_reward``: 1.0 when the normalized response equals the normalized label.

:data:`BUILTIN_REWARDS` maps each built-in spec name (``reward.function``) to its function; a
function joins it with ``@builtin_reward("name")`` where it is defined (the one list: the registry
resolves the names, config validation accepts them).
"""

from __future__ import annotations

import logging
import re
import string
import unicodedata

BUILTIN_REWARDS: dict = {}


def builtin_reward(name: str):
    """Register ``fn(prompt, response, label) -> float`` as the built-in reward spec ``name``."""

    def register(fn):
        if name in BUILTIN_REWARDS:
            raise ValueError(f"built-in reward {name!r} is registered twice")
        BUILTIN_REWARDS[name] = fn
        return fn

    return register


_PUNCT_TABLE = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPACES = re.compile(r"\s+")


def normalize_answer(text: str) -> str:
    """Lower-case, NFKC-normalize, drop punctuation and English articles, collapse whitespace
    (the usual SQuAD-style normalization)."""
    text = unicodedata.normalize("NFKC", str(text)).lower().translate(_PUNCT_TABLE)
    text = _ARTICLES.sub(" ", text)
    return _SPACES.sub(" ", text).strip()


def _math_verify():
    try:
        import math_verify
    except ImportError as e:  # optional dependency: only the math reward needs it
        raise ImportError("the 'math' reward needs the math-verify package (pip install math-verify)") from e
    # The runner bounds each call, so math-verify's signal timeouts are off; silence its warning.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


@builtin_reward("math")
def math_reward(prompt: str, response: str, label) -> float:
    """1.0 if math-verify judges the response's answer (boxed or last expression) equal to ``label``
    (a number or LaTeX string), else 0.0. math-verify's own timeouts are disabled: the reward
    runner bounds every call."""
    mv = _math_verify()
    gold_text = str(label)
    gold = mv.parse(gold_text if "$" in gold_text or "\\boxed" in gold_text else f"${gold_text}$", parsing_timeout=None)
    if not gold:
        gold = mv.parse(gold_text, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math reward: could not parse the label {gold_text!r}")
    answer = mv.parse(response, parsing_timeout=None)
    if not answer:
        return 0.0
    return float(mv.verify(gold, answer, timeout_seconds=None))


@builtin_reward("exact_match")
def exact_match_reward(prompt: str, response: str, label) -> float:
    """1.0 if ``normalize_answer(response) == normalize_answer(label)`` (label may be a list of
    accepted answers), else 0.0."""
    labels = label if isinstance(label, (list, tuple)) else [label]
    got = normalize_answer(response)
    return float(any(got == normalize_answer(str(lab)) for lab in labels))
