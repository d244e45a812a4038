import pytest

from gspo_megatron.rewards.runner import RewardRunner

USER_FN = """
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
"""


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


def test_a_round_where_every_call_fails_stops_with_the_last_error(runner):
    from gspo_megatron.errors import UserInputError
    from gspo_megatron.rewards.outcomes import RewardFailure

    with pytest.raises(
        RewardFailure,
        match=r"user_reward\.py:score.*failed on 3 of 3 calls.*last error: "
        r"ValueError: bad response",
    ) as e:
        runner.score(["p"] * 3, ["nan", "raise", "raise"], [0, 0, 0])
    assert isinstance(e.value, UserInputError)
    # partial failures keep scoring 0 and are counted (default share 1.0)
    rewards, stats = runner.score(["p"] * 3, ["raise", "a", "text"], [0, 0, 0])
    assert rewards == [0.0, 1.0, 0.0] and stats["reward/errors"] == 2.0


@pytest.mark.parametrize(
    "share,responses,fails",
    [
        (0.5, ["raise", "a"], True),
        (0.5, ["raise", "a", "b"], False),
        (1.0, ["nan", "nan"], True),
        (0.25, ["a", "b", "c", "text"], True),
        (0.3, ["a", "b", "c", "text"], False),
    ],
)
def test_inline_scorer_failure_share(tmp_path, share, responses, fails):
    from gspo_megatron.rewards.outcomes import RewardFailure
    from gspo_megatron.rewards.runner import InlineRewardScorer

    path = tmp_path / "user_reward.py"
    path.write_text(USER_FN)
    scorer = InlineRewardScorer(f"{path}:score", max_failure_share=share)
    n = len(responses)
    if fails:
        with pytest.raises(
            RewardFailure, match=f"failed on {sum(r in ('raise', 'nan', 'text') for r in responses)} of {n}"
        ):
            scorer.score(["p"] * n, responses, [0] * n)
    else:
        rewards, stats = scorer.score(["p"] * n, responses, [0] * n)
        assert stats["reward/errors"] + stats["reward/nonfinite"] == sum(
            r in ("raise", "nan", "text") for r in responses
        )


def test_returning_none_is_named():
    from gspo_megatron.rewards.outcomes import as_reward

    with pytest.raises(TypeError, match="returned NoneType None, expected a number"):
        as_reward(None)
    assert as_reward(True) == 1.0 and as_reward(3) == 3.0
