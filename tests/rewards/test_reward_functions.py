import builtins
import sys

import pytest

from gspo_megatron.data.answer_reward import shaped_integer_reward
from gspo_megatron.rewards import builtin
from gspo_megatron.rewards.builtin import exact_match_reward, math_reward, normalize_answer
from gspo_megatron.rewards.registry import get_reward_fn
from gspo_megatron.user_code import load_callable


def test_normalize_and_exact_match():
    assert normalize_answer("  The  Eiffel-Tower!! ") == "eiffeltower"
    assert normalize_answer("Ｐａｒｉｓ") == "paris"  # NFKC full-width
    assert exact_match_reward("", "Paris.", "paris") == 1.0
    assert exact_match_reward("", "a Paris", ["London", "Paris"]) == 1.0
    assert exact_match_reward("", "Lyon", "Paris") == 0.0


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("so the answer is \\boxed{42}", "42", 1.0),
        ("$0.5$", "\\frac{1}{2}", 1.0),
        ("x = 1/2", "0.5", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("no number here", "42", 0.0),
        ("$\\sqrt{4}$", "2", 1.0),
    ],
)
def test_math_reward_with_math_verify(response, label, expected):
    pytest.importorskip("math_verify")
    assert math_reward("q", response, label) == expected


def test_math_reward_names_the_missing_package(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "math_verify":
            raise ImportError("nope")
        return real_import(name, *a, **k)

    monkeypatch.delitem(sys.modules, "math_verify", raising=False)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match="math-verify"):
        builtin.math_reward("q", "1", "1")


def test_registry_builtins_tasks_and_user_files(tmp_path):
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("exact_match") is exact_match_reward
    for spec in ("last_digit", "task:last_digit", "add_digits"):
        assert get_reward_fn(spec)("p", "1", "1") == shaped_integer_reward("1", "1") == 1.0
    f = tmp_path / "my_reward.py"
    f.write_text("def score(prompt, response, label):\n    return float(response == label) * 2\n")
    fn = get_reward_fn(f"{f}:score")
    assert fn("p", "a", "a") == 2.0 and fn("p", "a", "b") == 0.0
    assert load_callable("gspo_megatron.rewards.builtin:exact_match_reward") is exact_match_reward


def test_every_builtin_reward_is_accepted_by_config_and_resolved():
    """One list of built-in reward names (rewards.builtin.BUILTIN_REWARDS): config validation accepts
    each, the registry resolves each to its function, and an unknown name's error lists them all."""
    from gspo_megatron.config import load_config
    from gspo_megatron.errors import ConfigError

    assert builtin.BUILTIN_REWARDS == {"math": math_reward, "exact_match": exact_match_reward}
    for name, fn in builtin.BUILTIN_REWARDS.items():
        load_config(None, [f"reward.function={name}"])
        assert get_reward_fn(name) is fn
    with pytest.raises(ConfigError, match="use one of math, exact_match, "):
        load_config(None, ["reward.function=maths"])


@pytest.mark.parametrize(
    "spec,error,match",
    [
        ("nope", ValueError, "unknown reward 'nope'"),
        ("", ValueError, "non-empty"),
        ("missing_file.py:fn", FileNotFoundError, "missing_file.py"),
        ("gspo_megatron.rewards.builtin:nope", AttributeError, "no attribute 'nope'"),
        ("gspo_megatron.rewards.builtin:1x", ValueError, "not a valid function name"),
        ("gspo_megatron.rewards.builtin:logging", TypeError, "not callable"),
    ],
)
def test_registry_errors_name_the_spec(spec, error, match):
    with pytest.raises(error, match=match):
        get_reward_fn(spec)
