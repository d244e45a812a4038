"""``rollout.inflight_updates``' engine side: ``engines.partial.generate_group`` (abort mode: partial
outputs resubmitted as continuations, tokens / log-probs / versions merged in order) against a
scripted engine, and the pause / flush / continue sequence a sync sends in each mode
(``sglang_client.open_weight_update`` / ``close_weight_update``)."""

from __future__ import annotations

import pytest

from gspo_megatron.engines.base import RolloutSample, SamplingParams
from gspo_megatron.engines.partial import generate_group
from gspo_megatron.engines.sglang_client import SGLangHttpClient, close_weight_update, open_weight_update
from gspo_megatron.orchestration.inflight import first_span

PROMPT = [1, 2, 3]
EOS = 9


class ScriptedEngine:
    """Answers each input from a script: the k-th call's answers, one per input; records the calls."""

    def __init__(self, script):
        self.script, self.calls = list(script), []

    def generate_partial(self, inputs, params, index):
        self.calls.append(([list(i) for i in inputs], [p.max_new_tokens for p in params], [p.seed for p in params]))
        answers = self.script.pop(0)
        assert len(answers) == len(inputs)
        return [
            RolloutSample(list(i), ids, [-0.5 - t for t in ids], finish, [v] * len(ids))
            for i, (ids, finish, v) in zip(inputs, answers)
        ]


def test_aborted_samples_continue_under_the_new_version():
    params = SamplingParams(max_new_tokens=6, stop_token_ids=[EOS], seed=100)
    engine = ScriptedEngine(
        [
            [([4, 5], "abort", "v1"), ([6, EOS], "stop", "v1"), ([], "abort", "v1")],
            [([7, EOS], "stop", "v2"), ([8, 8, 8, 8, 8, 8], "length", "v2")],
        ]
    )
    samples, resubmitted = generate_group(engine, PROMPT, 3, params, index=5)
    assert resubmitted == 2
    a, b, c = samples
    assert (a.response_ids, a.finish_reason, a.token_versions) == ([4, 5, 7, EOS], "stop", ["v1", "v1", "v2", "v2"])
    assert a.response_logprobs == [-4.5, -5.5, -7.5, -9.5] and a.prompt_ids == PROMPT
    assert (b.response_ids, b.token_versions) == ([6, EOS], ["v1", "v1"])
    assert c.response_ids == [8] * 6 and c.finish_reason == "length" and c.token_versions == ["v2"] * 6
    # the continuation: prompt + tokens so far, the budget left, a seed of its own
    inputs, budgets, seeds = engine.calls[1]
    assert inputs == [PROMPT + [4, 5], PROMPT] and budgets == [4, 6] and seeds == [100 + 7919 * 2, 102]


def test_an_abort_that_ended_the_sample_is_not_resubmitted():
    params = SamplingParams(max_new_tokens=3, stop_token_ids=[EOS])
    engine = ScriptedEngine([[([4, EOS], "abort", "v1"), ([4, 4, 4], "abort", "v1")]])
    samples, resubmitted = generate_group(engine, PROMPT, 2, params, index=0)
    assert resubmitted == 0 and [s.finish_reason for s in samples] == ["stop", "length"]


def test_first_span():
    assert first_span(["a", "a", "b", "a"]) == 2 and first_span(["a"]) == 1 and first_span([]) == 0


class Recorder(SGLangHttpClient):
    def __init__(self, mode):
        super().__init__("http://engine", pause_mode=mode)
        self.sent: list[tuple[str, object]] = []
        self._has_sessions = True

    def post(self, route, payload=None, **kw):
        self.sent.append((route, payload))
        return {"success": True}


@pytest.mark.parametrize(
    "mode, opened, closed",
    [
        # sglang's default pause aborts (nothing runs then in the synchronous loop); flush around the update
        ("abort", [("pause_generation", None), ("flush_cache", None)], [("flush_cache", None)]),
        ("retract", [("pause_generation", {"mode": "retract"}), ("flush_cache", None)], [("flush_cache", None)]),
        # in place: sglang refuses /flush_cache with requests running; they keep their KV cache
        ("in_place", [("pause_generation", {"mode": "in_place"})], []),
    ],
)
def test_a_sync_pauses_in_the_clients_mode(mode, opened, closed):
    c = Recorder(mode)
    open_weight_update(c)
    assert c.sent == [*opened, ("begin_weight_update", {})]
    c.sent.clear()
    close_weight_update(c)
    assert c.sent == [("end_weight_update", {}), *closed, ("continue_generation", None)]


def test_unknown_pause_mode_is_refused():
    with pytest.raises(ValueError, match="pause_mode must be one of"):
        SGLangHttpClient("http://e", pause_mode="drain")
