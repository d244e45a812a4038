import pytest

from gspo_megatron.data.answer_reward import CLEAN_CREDIT, CORRECT_CREDIT, FORMAT_CREDIT, shaped_integer_reward
from gspo_megatron.data.tasks import TASKS, get_task


def test_rows_are_deterministic_from_seed_and_labels_correct():
    task = get_task("last_digit")
    a, b, c = task.rows(50, seed=1), task.rows(50, seed=1), task.rows(50, seed=2)
    assert a == b and a != c
    for row in a:
        number = row["prompt"].removeprefix("last digit of ").removesuffix("?")
        assert row["label"] == number[-1]
    for row in get_task("add_digits").rows(50, seed=0):
        x, y = row["prompt"].removesuffix("=").split("+")
        assert int(row["label"]) == int(x) + int(y)


def test_credits_sum_to_one():
    assert FORMAT_CREDIT + CLEAN_CREDIT + CORRECT_CREDIT == pytest.approx(1.0)


@pytest.mark.parametrize(
    "response,label,expected",
    [
        ("1", "1", FORMAT_CREDIT + CLEAN_CREDIT + CORRECT_CREDIT),
        (" 1\n", "1", FORMAT_CREDIT + CLEAN_CREDIT + CORRECT_CREDIT),
        ("1x", "1", FORMAT_CREDIT + CORRECT_CREDIT),
        ("1<|pad|>", "1", FORMAT_CREDIT + CORRECT_CREDIT),
        ("11", "1", FORMAT_CREDIT + CORRECT_CREDIT),
        ("7", "1", FORMAT_CREDIT + CLEAN_CREDIT),
        ("77", "1", FORMAT_CREDIT),
        ("7x", "1", FORMAT_CREDIT),
        ("12", "12", 1.0),
        ("1", "12", FORMAT_CREDIT),
        ("13", "12", FORMAT_CREDIT + CLEAN_CREDIT),
        ("x1", "1", 0.0),
        ("²", "2", 0.0),
        ("", "1", 0.0),
    ],
)
def test_shaped_reward(response, label, expected):
    assert shaped_integer_reward(response, label) == pytest.approx(expected)
    assert TASKS["last_digit"].reward("p", response, label) == pytest.approx(expected)


def test_unknown_task_names_the_choices():
    with pytest.raises(KeyError, match="last_digit"):
        get_task("nope")
