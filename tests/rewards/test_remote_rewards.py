"""Remote rewards against the reference server (gspo_megatron/rewards/reference_server.py): the same
rewards as local scoring (per sample and per group), and a server that hangs, errors or dies: each
costs a scoring round at most reward.timeout_s, is counted per sample, and the next round goes on."""

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from gspo_megatron.rewards.outcomes import RewardFailure
from gspo_megatron.rewards.remote import RemoteRewardScorer
from gspo_megatron.rewards.runner import InlineRewardScorer, RewardRunner
from gspo_megatron.runtime.ports import free_port

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

GROUP_FN = '''
import math

def rank_score(prompt, responses, label):
    """1 for the responses equal to the label, minus 0.1 times how many responses share the text."""
    if responses[0] == "raise":
        raise ValueError("bad group")
    if responses[0] == "nan":
        return [math.nan] * len(responses)
    return [float(r == label) - 0.1 * responses.count(r) for r in responses]
'''

PER_SAMPLE_FN = """
def score(prompt, response, label):
    if response == "raise":
        raise ValueError("bad response")
    return float(response == label) + len(prompt) / 100
"""


def _user_file(tmp_path, text, name):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_remote_equals_local_per_sample(serve, tmp_path):
    spec = _user_file(tmp_path, PER_SAMPLE_FN, "per_sample.py") + ":score"
    url, faults = serve(spec)
    prompts = [f"prompt {i // 3}" for i in range(30)]
    responses = ["7" if i % 4 == 0 else "raise" if i == 5 else "x" for i in range(30)]
    labels = ["7"] * 30
    remote = RemoteRewardScorer(url, timeout_s=30, batch_size=4, max_in_flight=3)
    got, stats = remote.score(prompts, responses, labels, group_size=3)
    want, want_stats = InlineRewardScorer(spec).score(prompts, responses, labels)
    assert got == want and stats["reward/errors"] == want_stats["reward/errors"] == 1
    assert stats["reward/remote_requests"] == 8 == faults.count  # ceil(30 / 4) batches, no retry
    assert 1 <= remote.max_seen_in_flight <= 3 and faults.max_open <= 3


def test_group_rewards_local_pool_and_remote_agree(serve, tmp_path):
    spec = _user_file(tmp_path, GROUP_FN, "group_fn.py") + ":rank_score"
    G = 4
    prompts = [f"p{g}" for g in range(5) for _ in range(G)]
    labels = [str(g) for g in range(5) for _ in range(G)]
    responses = [
        "0",
        "0",
        "1",
        "0",
        "1",
        "1",
        "1",
        "x",
        "raise",
        "a",
        "b",
        "c",
        "3",
        "y",
        "3",
        "z",
        "nan",
        "4",
        "4",
        "4",
    ]
    # the group function sees the whole group: duplicates lower every member's score
    want = []
    for g in range(5):
        rs = responses[g * G : (g + 1) * G]
        if rs[0] in ("raise", "nan"):
            want += [0.0] * G
        else:
            want += [float(r == labels[g * G]) - 0.1 * rs.count(r) for r in rs]
    url, faults = serve(spec, group=True)
    results = {
        "inline": InlineRewardScorer(spec, group=True).score(prompts, responses, labels, group_size=G),
        "remote": RemoteRewardScorer(url, timeout_s=30, batch_size=2, group=True).score(
            prompts, responses, labels, group_size=G
        ),
    }
    with RewardRunner(spec, num_workers=2, timeout_s=30, group=True) as pool:
        results["pool"] = pool.score(prompts, responses, labels, group_size=G)
    for name, (got, stats) in results.items():
        assert got == pytest.approx(want), name
        # a failed group costs its G samples: one raising group, one NaN group
        assert (stats["reward/errors"], stats["reward/nonfinite"]) == (G, G), name
    assert faults.count == 3  # 5 groups, 2 per request
    with pytest.raises(ValueError, match="not one prompt's group"):
        InlineRewardScorer(spec, group=True).score(["a", "b"], ["1", "2"], ["1", "1"], group_size=2)


def test_hanging_server_costs_the_round_its_timeout_and_is_counted(serve, tmp_path):
    url, faults = serve("exact_match", plan={2: "hang"})
    remote = RemoteRewardScorer(url, timeout_s=2.0, batch_size=4, max_in_flight=4)
    n = 16
    t0 = time.monotonic()
    got, stats = remote.score(["p"] * n, ["a"] * n, ["a"] * n)
    elapsed = time.monotonic() - t0
    # the hung request's 4 samples time out; the other batches were answered
    assert stats["reward/timeouts"] == 4 and stats["reward/errors"] == 0
    assert sorted(got) == [0.0] * 4 + [1.0] * 12
    assert 2.0 <= elapsed < 30  # it waited for the timeout, not for the server (which hangs 600 s)
    # the next round goes on
    got, stats = remote.score(["p"] * 4, ["a"] * 4, ["a"] * 4)
    assert got == [1.0] * 4 and stats["reward/timeouts"] == 0


def test_erroring_server_is_retried_then_counted(serve):
    # request 1 errors once (then answered on retry); requests 2-4 error: that batch exhausts retries=2
    url, faults = serve("exact_match", plan={1: "error", 3: "error", 4: "error", 5: "error"})
    remote = RemoteRewardScorer(url, timeout_s=30, batch_size=4, max_in_flight=1, retries=2, backoff_s=0.01)
    got, stats = remote.score(["p"] * 8, ["a"] * 8, ["a"] * 8)
    assert got == [1.0] * 4 + [0.0] * 4
    assert stats["reward/errors"] == 4 and stats["reward/remote_retries"] == 3
    assert stats["reward/remote_requests"] == 5 == faults.count
    assert "HTTP 500" in remote.last_error and "after 3 attempts" in remote.last_error


def test_server_dropping_connections_is_counted_and_retried(serve):
    url, faults = serve("exact_match", plan={1: "drop", 3: "drop"})
    remote = RemoteRewardScorer(url, timeout_s=30, batch_size=4, max_in_flight=1, retries=0)
    got, stats = remote.score(["p"] * 8, ["a"] * 8, ["a"] * 8)  # request 1 dropped, request 2 answered
    assert got == [0.0] * 4 + [1.0] * 4 and stats["reward/errors"] == 4
    assert "RemoteDisconnected" in remote.last_error
    remote = RemoteRewardScorer(url, timeout_s=30, batch_size=4, max_in_flight=1, retries=1, backoff_s=0.01)
    got, stats = remote.score(["p"] * 8, ["a"] * 8, ["a"] * 8)  # request 3 dropped, its retry (4) answered
    assert got == [1.0] * 8 and stats["reward/remote_retries"] == 1 and faults.count == 5


def _start_reference_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gspo_megatron.rewards.reference_server",
            "--function",
            "exact_match",
            "--port",
            str(port),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
    )
    line = proc.stdout.readline()
    assert f"listening on http://127.0.0.1:{port}/score" in line, line
    return proc


def test_dead_reference_server_fails_fast_counted_then_recovers():
    """The reference server as users start it (python -m), killed and restarted on its port."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/score"
    proc = _start_reference_server(port)
    try:
        remote = RemoteRewardScorer(
            url, timeout_s=20, batch_size=3, max_in_flight=2, retries=2, backoff_s=0.01, max_failure_share=1.0
        )
        assert remote.score(["p"] * 5, ["a", "b", "a", "a", "c"], ["a"] * 5)[0] == [1, 0, 1, 1, 0]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(
            RewardFailure,
            match=r"reward.url 'http://127.0.0.1:\d+/score' failed on 5 of 5 calls"
            r".*after 3 attempts",
        ):
            remote.score(["p"] * 5, ["a"] * 5, ["a"] * 5)
        assert time.monotonic() - t0 < 20  # refused connections fail fast, retries included
        proc = _start_reference_server(port)  # the server comes back: the next round is scored
        got, stats = remote.score(["p"] * 4, ["a"] * 4, ["a"] * 4)
        assert got == [1.0] * 4 and stats["reward/errors"] == 0
        # GET /health
        import urllib.request

        assert json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read()) == {"ok": True}
    finally:
        proc.kill()
        proc.wait(10)


def test_server_answers_null_and_nan_are_counted(serve, tmp_path):
    spec = (
        _user_file(
            tmp_path,
            PER_SAMPLE_FN.replace("return float(", 'return float("nan") if response == "nan" else float('),
            "nan_fn.py",
        )
        + ":score"
    )
    url, _ = serve(spec)
    got, stats = RemoteRewardScorer(url, timeout_s=30).score(["p"] * 3, ["raise", "nan", "7"], ["7"] * 3)
    assert got[:2] == [0.0, 0.0] and math.isclose(got[2], 1.01)
    assert stats["reward/errors"] == 1 and stats["reward/nonfinite"] == 1


def test_mode_mismatch_is_an_error_not_retried(serve):
    url, faults = serve("exact_match", group=False)
    remote = RemoteRewardScorer(url, timeout_s=30, group=True, retries=3, max_failure_share=1.0)
    with pytest.raises(RewardFailure, match="HTTP 400.*scores mode single"):
        remote.score(["p"] * 2, ["a"] * 2, ["a"] * 2, group_size=2)
    assert faults.count == 1
