"""Over-sampling with dynamic sampling (rollout.over_sample): one draw of ceil(over_sample * needed)
prompts, generation stopped once enough informative groups are in; SGLang's stream cancels the
requests not yet sent."""

import sys
import threading
import time

import pytest

from gspo_megatron.config import Config, load_config
from gspo_megatron.data.dataset import PromptDataset, PromptSampler
from gspo_megatron.data.tokenizer import build_demo_tokenizer
from gspo_megatron.engines.base import RolloutEngine, RolloutSample, SamplingParams
from gspo_megatron.engines.sglang_engine import SGLangRolloutEngine
from gspo_megatron.errors import ConfigError
from gspo_megatron.orchestration.batch import collect_rollouts
from gspo_megatron.rewards.runner import InlineRewardScorer


@pytest.fixture(scope="module")
def tokenizer():
    return build_demo_tokenizer()


class StreamingEngine(RolloutEngine):
    """Prompt "m<k>" gets mixed answers "1"/"2" (an informative group under exact_match with label
    "1"), prompt "s<k>" the same answer "1" for all (zero variance). Delivers one group at a time
    and counts the groups it was asked for."""

    def __init__(self, tokenizer):
        self.tok, self.delivered, self.requested = tokenizer, 0, 0

    def _group(self, prompt, n):
        text = self.tok.decode(prompt)
        mixed = "user\nm" in text
        out = []
        for j in range(n):
            ids = self.tok.encode("1" if (not mixed or j % 2 == 0) else "2", add_special_tokens=False)
            out.append(RolloutSample(list(prompt), ids + [self.tok.eos_token_id], [-0.5, -0.1], "stop"))
        return out

    def generate(self, prompts, n, params):
        return [self._group(p, n) for p in prompts]

    def generate_stream(self, prompts, n, params):
        self.requested += len(prompts)
        for i, p in enumerate(prompts):
            self.delivered += 1
            yield [(i, self._group(p, n))]


def _setup(tokenizer, pattern, over_sample, dynamic=True, rounds=3):
    rows = [{"prompt": f"{c}{k}", "label": "1"} for k, c in enumerate(pattern)]
    ds = PromptDataset.from_records(rows, tokenizer, source="t")
    cfg = Config()
    cfg.rollout.group_size, cfg.rollout.prompts_per_step = 4, 4
    cfg.rollout.dynamic_sampling, cfg.rollout.over_sample = dynamic, over_sample
    cfg.rollout.max_resample_rounds = rounds
    cfg.reward.function = "exact_match"
    return cfg, ds, PromptSampler(len(ds), seed=0, shuffle=False), InlineRewardScorer("exact_match")


def test_over_sampling_stops_generating_once_enough_informative_groups_are_in(tokenizer):
    # 8 prompts drawn at once (2 x 4 needed); the 4th informative group is the 7th prompt
    cfg, ds, sampler, rewards = _setup(tokenizer, "msmsmsmssssssss", over_sample=2.0)
    engine = StreamingEngine(tokenizer)
    batch = collect_rollouts(cfg, 1, engine, ds, sampler, tokenizer, rewards)
    assert engine.requested == 8 and engine.delivered == 7  # the 8th group was never generated
    m = batch.metrics
    assert (m["rollout/prompts_drawn"], m["rollout/groups_generated"], m["rollout/rounds"]) == (8.0, 7.0, 1.0)
    assert len(batch.records) == 16
    groups = [batch.records[i : i + 4] for i in range(0, 16, 4)]
    for g in groups:  # every kept group is informative: rewards 1, 0, 1, 0
        assert [r.reward for r in g] == [1.0, 0.0, 1.0, 0.0]
        assert abs(sum(r.advantage for r in g)) < 1e-6 and g[0].advantage > 0
    assert m["rollout/zero_variance_frac"] == pytest.approx(3 / 7)
    assert sampler.state_dict()["index"] == 8


def test_without_over_sampling_dynamic_sampling_needs_rounds(tokenizer):
    cfg, ds, sampler, rewards = _setup(tokenizer, "msmsmsmssssssss", over_sample=1.0)
    engine = StreamingEngine(tokenizer)
    batch = collect_rollouts(cfg, 1, engine, ds, sampler, tokenizer, rewards)
    m = batch.metrics
    # round 1: 4 prompts (2 informative), round 2: 2 more (1), round 3: 1 more (1 informative: m6)
    assert (m["rollout/rounds"], m["rollout/prompts_drawn"], m["rollout/groups_generated"]) == (3.0, 7.0, 7.0)
    assert all(g.reward in (0.0, 1.0) for g in batch.records)


def test_over_sampling_falls_back_to_zero_variance_groups_when_rounds_run_out(tokenizer):
    cfg, ds, sampler, rewards = _setup(tokenizer, "mssssssssssssssssss", over_sample=1.5, rounds=1)
    engine = StreamingEngine(tokenizer)
    batch = collect_rollouts(cfg, 1, engine, ds, sampler, tokenizer, rewards)
    m = batch.metrics
    # round 1: 6 prompts (1 informative); round 2: ceil(1.5 * 3) = 5 prompts, none informative
    assert (m["rollout/rounds"], m["rollout/prompts_drawn"], m["rollout/groups_generated"]) == (2.0, 11.0, 11.0)
    assert len(batch.records) == 16  # the batch is filled with zero-variance groups (advantage 0)
    assert sum(1 for r in batch.records if r.advantage != 0) == 4


def test_default_stream_is_one_generate_call(tokenizer):
    """Engines without their own stream (transformers engine, engine subprocess) deliver everything
    from one generate call: over-sampling still draws the prompts at once (no rounds)."""

    class OneCall(StreamingEngine):
        generate_stream = RolloutEngine.generate_stream

        def generate(self, prompts, n, params):
            self.requested += len(prompts)
            return super().generate(prompts, n, params)

    cfg, ds, sampler, rewards = _setup(tokenizer, "msmsmsmssssssss", over_sample=2.0)
    engine = OneCall(tokenizer)
    batch = collect_rollouts(cfg, 1, engine, ds, sampler, tokenizer, rewards)
    assert engine.requested == 8 and batch.metrics["rollout/rounds"] == 1.0
    assert batch.metrics["rollout/groups_generated"] == 8.0


def test_config_checks():
    with pytest.raises(ConfigError, match="rollout.over_sample must be >= 1"):
        load_config(None, ["rollout.over_sample=0.5", "rollout.dynamic_sampling=true"])
    with pytest.raises(ConfigError, match="rollout.over_sample > 1 needs rollout.dynamic_sampling=true"):
        load_config(None, ["rollout.over_sample=2"])


class FakeClient:
    """Answers SGLang /generate like the server (meta_info.output_token_logprobs), one request at a
    time, blocking each until the test releases it."""

    def __init__(self):
        self.sent, self.gate = [], threading.Semaphore(0)

    def generate(self, ids, sps, return_logprob=True, batch=True):
        self.sent.append(ids[0])
        self.gate.acquire()
        return [
            {"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.1, 7, None]]}} for _ in ids
        ]


def test_sglang_stream_cancels_requests_not_yet_sent():
    client = FakeClient()
    engine = SGLangRolloutEngine([client], max_concurrency=2)
    prompts = [[1, k] for k in range(6)]
    stream = engine.generate_stream(prompts, 2, SamplingParams(max_new_tokens=1))
    client.gate.release()  # one request may finish; the two workers then hold requests 2 and 3
    ((i, group),) = next(stream)
    assert len(group) == 2 and group[0].response_ids == [7]
    # the in-flight requests are let go only after close() has cancelled the queued ones
    # (close cancels first, then waits for what is in flight)
    main = threading.get_ident()

    def release_once_close_waits():  # close() is joining the workers: the queued ones are cancelled
        while True:
            frame, names = sys._current_frames().get(main), set()
            while frame is not None:
                names.add(frame.f_code.co_name)
                frame = frame.f_back
            if {"shutdown", "join"} <= names:
                break
            time.sleep(0.01)
        for _ in range(6):
            client.gate.release()

    releaser = threading.Thread(target=release_once_close_waits, daemon=True)
    releaser.start()
    stream.close()
    releaser.join(timeout=60)
    # requests 4..6 were never sent. Request 3 is sent only if the worker freed by the first answer
    # took it from the queue before close() cancelled the queue (a race between two threads: both
    # outcomes are correct)
    assert sorted(client.sent) in (prompts[:2], prompts[:3]), client.sent


class ShuffledEngine(StreamingEngine):
    """Delivers the groups in an order given by ``order_seed`` (several engines finishing in a
    different order from run to run)."""

    def __init__(self, tokenizer, order_seed):
        super().__init__(tokenizer)
        self.order_seed = order_seed

    def generate_stream(self, prompts, n, params):
        import random

        order = list(range(len(prompts)))
        random.Random(self.order_seed).shuffle(order)
        self.requested += len(prompts)
        for i in order:
            self.delivered += 1
            yield [(i, self._group(prompts[i], n))]


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_batch_is_in_prompt_order_whatever_the_delivery_order(tokenizer, dynamic):
    """Two runs whose engines deliver the same groups in different orders get the same batch, in the
    order the prompts were drawn (round, then place in the round)."""
    batches = []
    for order_seed in (0, 1, 2):
        cfg, ds, sampler, rewards = _setup(tokenizer, "msmmsmsmssssssss", over_sample=1.0, dynamic=dynamic)
        batch = collect_rollouts(cfg, 1, ShuffledEngine(tokenizer, order_seed), ds, sampler, tokenizer, rewards)
        batches.append([(tokenizer.decode(r.prompt_ids), r.reward, r.advantage) for r in batch.records])
    assert batches[0] == batches[1] == batches[2]
    drawn = [f"{c}{k}" for k, c in enumerate("msmmsmsmssssssss")]
    # each group's prompt, as its place among the drawn prompts: ascending within a round
    places = [next(i for i, d in enumerate(drawn) if f"user\n{d}" in text) for text, _, _ in batches[0][::4]]
    if not dynamic:
        assert places == [0, 1, 2, 3]
    else:  # round 1 gives m0 m2 m3 (s1 dropped), round 2 m5: informative groups, in drawing order
        assert places == [0, 2, 3, 5]
