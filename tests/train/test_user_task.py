"""Training with the user's own data file and reward function from the command line (a task that
is not the demo's), and the resume contract."""

import json
import os

import pytest

from train_utils import read_metrics, run_train

REWARD_SRC = """
import json
import os

def score(prompt, response, label):
    # reward: the response contains the label's letter; every call is logged to prove it ran
    log = os.environ["GSPO_TEST_REWARD_LOG"]
    first_hang = label == "hang" and not os.path.exists(log + ".hung")
    with open(log, "a") as f:
        f.write(json.dumps([prompt, response, label]) + "\\n")
    if first_hang:  # the first call for the "hang" row hangs: cut by reward.timeout_s, scored 0, counted
        open(log + ".hung", "w").close()
        import time; time.sleep(600)
    return 1.0 if str(label)[0] in response else 0.0
"""


def test_user_data_and_reward_function(tmp_path, monkeypatch):
    data = tmp_path / "letters.jsonl"
    # 8 rows = 2 steps * 4 prompts: one epoch, so every row (the "hang" row too) is drawn exactly once
    rows = [{"question": f"write the letter {c}", "answer": c} for c in "abcdefg"]
    rows.append({"question": "write the letter h", "answer": "hang"})
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD_SRC)
    log = tmp_path / "calls.log"
    monkeypatch.setenv("GSPO_TEST_REWARD_LOG", str(log))
    out = tmp_path / "run"
    run_train(
        str(out),
        [
            f"data.path={data}",
            "data.prompt_key=question",
            "data.label_key=answer",
            f"reward.function={reward}:score",
            "reward.num_workers=1",
            "reward.timeout_s=2",
            "train.steps=2",
            "rollout.dynamic_sampling=false",
        ],
    )  # one sampling round: an exact call count
    metrics = read_metrics(str(out))
    assert [m["step"] for m in metrics] == [1, 2]
    calls = log.read_text().splitlines()
    assert len(calls) == 1 + 2 * 4 * 4  # the start-up check's one call + steps * prompts * group size
    prompts = {json.loads(c)[0] for c in calls}
    assert prompts == {r["question"] for r in rows}
    assert sum(json.loads(c)[2] == "hang" for c in calls) == 4  # the hanging row's group, every call made
    for m in metrics:
        for key in (
            "reward/mean",
            "reward/std",
            "loss/policy",
            "gspo/clip_frac",
            "gspo/ratio_mean",
            "rollout/logprob_abs_diff",
            "rollout/response_len_mean",
            "perf/step_time_s",
            "perf/tokens_per_s",
        ):
            assert key in m, key
        assert m["reward/errors"] == 0 and m["reward/nonfinite"] == 0
    assert sum(m["reward/timeouts"] for m in metrics) == 1  # the hung call was cut and counted
    assert os.path.exists(out / "hf_final" / "config.json")


def test_bad_data_row_names_file_and_line(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "ok", "label": "1"}\n{"prompt": \n')
    proc = run_train(str(tmp_path / "run"), [f"data.path={data}"], check=False)
    assert proc.returncode != 0
    assert f"{data}" in proc.stderr and "line 2" in proc.stderr


def test_resume_reproduces_uninterrupted_run(tmp_path):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_train(full, ["train.steps=4"])
    run_train(part, ["train.steps=2", "checkpoint.interval=2"])  # "killed" after the step-2 checkpoint
    run_train(part, ["train.steps=4", "checkpoint.interval=2"])  # same command, more steps: resumes
    a, b = read_metrics(full), read_metrics(part)
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        for k in ("reward/mean", "loss/total", "gspo/ratio_mean", "train/grad_norm"):
            assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), (k, x["step"])
