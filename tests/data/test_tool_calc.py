"""The calculator tool of the tool-calling example, and its task rows."""

import random

import pytest

from gspo_megatron.data.tasks import get_task
from gspo_megatron.data.tool_calc import calculator, make_row


@pytest.mark.parametrize(
    "expr, want",
    [
        ("7*8", "56"),
        ("3+4", "7"),
        (" 9 - 12 ", "-3"),
        ("(2+3)*4", "20"),
        ("-5*-5", "25"),
        ("0", "0"),
        ("2**10", "error"),
        ("7/2", "error"),
        ("__import__('os')", "error"),
        ("x+1", "error"),
        ("", "error"),
        ("1.5+1", "error"),
        ("'a'*3", "error"),
        ("9" * 7 + "*" + "9" * 7, "error"),
        ("1+" * 40 + "1", "error"),
        ("True+1", "error"),
    ],
)
def test_calculator(expr, want):
    assert calculator(expr) == want


def test_rows_and_labels_agree_with_the_calculator():
    rng = random.Random(0)
    for _ in range(200):
        row = make_row(rng)
        assert calculator(row["prompt"].split("=")[0]) == row["label"]
    rows = get_task("tool_calc").rows(5, seed=1)
    assert rows == get_task("tool_calc").rows(5, seed=1) and rows[0]["prompt"].endswith("=?")
