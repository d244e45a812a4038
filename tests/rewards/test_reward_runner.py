import pytest

from gspo_megatron.rewards.runner import RewardRunner

USER_FN = '''
import math, os, time

def score(prompt, response, label):
    if response == "hang":
        time.sleep(10_000)
    if response == "raise":
        raise ValueError("bad response")
    if response == "nan":
        return math.nan
    if response == "inf":
        return -math.inf
    if response == "crash":
        os._exit(7)
    if response == "text":
        return "not a number"
    if response == "exit":
        raise SystemExit(3)
    return float(len(response)) + float(label)
'''


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("rw") / "user_reward.py"
    path.write_text(USER_FN)
    with RewardRunner(f"{path}:score", num_workers=2, timeout_s=1.0) as r:
        yield r


def test_scores_in_order_with_a_persistent_pool(runner):
    responses = ["a" * i for i in range(20)]
    pids = [w.proc.pid for w in runner._workers]
    rewards, stats = runner.score(["p"] * 20, responses, [0.5] * 20)
    assert rewards == [i + 0.5 for i in range(20)]
    assert stats == {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/nonfinite": 0.0}
    runner.score(["p"], ["x"], [0])
    assert [w.proc.pid for w in runner._workers] == pids  # no restart between calls


def test_failures_score_zero_and_are_counted(runner):
    responses = ["ok", "hang", "raise", "nan", "inf", "crash", "text", "exit", "okay"]
    restarts = runner.restarts
    rewards, stats = runner.score(["p"] * len(responses), responses, [1] * len(responses))
    assert rewards == [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0]
    assert stats == {"reward/errors": 4.0, "reward/timeouts": 1.0, "reward/nonfinite": 2.0}
    assert runner.restarts == restarts + 2  # the hung worker and the crashed one were replaced
    # the pool keeps working after replacements
    assert runner.score(["p", "p"], ["ab", "abc"], [0, 0])[0] == [2.0, 3.0]


def test_every_worker_hanging_at_once_does_not_block(runner):
    rewards, stats = runner.score(["p"] * 3, ["hang", "hang", "a"], [0, 0, 0])
    assert rewards == [0.0, 0.0, 1.0] and stats["reward/timeouts"] == 2.0


def test_length_mismatch(runner):
    with pytest.raises(ValueError, match="differ in length"):
        runner.score(["p"], ["a", "b"], [0])


def test_bad_spec_fails_at_start_with_the_worker_traceback(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)could not load reward .nope.*unknown reward"):
        RewardRunner("nope", num_workers=1)
    f = tmp_path / "broken.py"
    f.write_text("raise ImportError('broken user file')\n")
    with pytest.raises(RuntimeError, match="broken user file"):
        RewardRunner(f"{f}:fn", num_workers=1)


def test_builtin_math_in_worker():
    pytest.importorskip("math_verify")
    with RewardRunner("math", num_workers=1) as r:
        rewards, stats = r.score(["q"] * 2, ["\\boxed{\\frac{2}{4}}", "0.3"], ["0.5", "1/2"])
    assert rewards == [1.0, 0.0] and stats["reward/errors"] == 0.0
