"""Start-up checks of the eval sets and of group rewards: one line naming the entry, file and line
(or the function and what it returned), before any model is built."""

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.data.dataset import PromptRow
from gspo_megatron.errors import UserInputError
from gspo_megatron.preflight import check_eval_data, check_reward


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from gspo_megatron.data.tokenizer import build_demo_tokenizer, load_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_demo_tokenizer(str(d))
    return load_tokenizer(str(d))


def test_a_malformed_eval_row_names_the_entry_file_and_line(tmp_path, tokenizer):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "last digit of 12?", "label": "2"}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "last digit of 12?", "label": "2"}\n{"prompt": "x"}\n')
    cfg = load_config(None, ["eval.interval=1", f"eval.datasets=[ok={good},{bad}]", "data.apply_chat_template=false"])
    with pytest.raises(UserInputError, match=rf"eval.datasets\[1\]: {bad} line 2: missing key 'label'"):
        check_eval_data(cfg, tokenizer)
    cfg.eval.datasets = [f"ok={good}"]
    check_eval_data(cfg, tokenizer)  # passes


def test_group_reward_checked_as_a_group_function(tmp_path):
    row = PromptRow(prompt="q", text="q", prompt_ids=[1], label="2", source="data.jsonl line 1")
    f = tmp_path / "g.py"
    f.write_text(
        "def rank(prompt, responses, label):\n    return [float(r == label) for r in responses]\n"
        "def one(prompt, responses, label):\n    return 1.0\n"
        "def short(prompt, responses, label):\n    return [1.0]\n"
    )
    check_reward(f"{f}:rank", row, group=True)
    with pytest.raises(
        UserInputError,
        match=r"reward.function .*g.py:one' failed .*reward.group=true.*"
        r"returned float 1.0, expected a list of 2 numbers",
    ):
        check_reward(f"{f}:one", row, group=True)
    with pytest.raises(UserInputError, match="returned 1 values for a group of 2 responses"):
        check_reward(f"{f}:short", row, group=True)
