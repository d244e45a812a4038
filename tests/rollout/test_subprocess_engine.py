import os
import signal
import threading

import pytest
import torch
from transformers import Qwen3MoeConfig

from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.hf_engine import HFRolloutEngine
from gspo_megatron.engines.subprocess_engine import EngineCallError, EngineDiedError, SubprocessRolloutEngine

CONFIG = Qwen3MoeConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)
PARAMS = SamplingParams(temperature=0.8, max_new_tokens=6, stop_token_ids=[3], seed=1)
PROMPTS = [[5, 6, 7], [9, 10]]
LONG = SamplingParams(max_new_tokens=10_000_000, seed=0)  # runs until killed


def bucket_from(engine):
    names = engine.checkpoint_names()
    return [(n, engine.layout.target(n).detach().clone()) for n in names]


@pytest.fixture(scope="module")
def pair():
    reference = HFRolloutEngine(CONFIG, seed=42)  # the weights the child must end up with
    child = SubprocessRolloutEngine(HFRolloutEngine, {"config": CONFIG, "seed": 0}, call_timeout_s=120)
    yield reference, child
    child.shutdown()


def sync(child, reference):
    child.begin_weight_update()
    bucket = bucket_from(reference)
    for i in range(0, len(bucket), 5):
        child.update_weights(bucket[i : i + 5])
    child.end_weight_update()


def ids(groups):
    return [[(s.response_ids, s.response_logprobs, s.finish_reason) for s in g] for g in groups]


def test_forwards_generation_and_weight_sync(pair):
    reference, child = pair
    assert child.health_check()
    sync(child, reference)
    names = reference.checkpoint_names()
    assert child.weight_checksums(names) == reference.weight_checksums(names)
    assert child.call("checkpoint_names") == names
    assert ids(child.generate(PROMPTS, 3, PARAMS)) == ids(reference.generate(PROMPTS, 3, PARAMS))


def test_engine_exception_is_reported_and_engine_survives(pair):
    _, child = pair
    with pytest.raises(EngineCallError, match="(?s)during generate.*temperature"):
        child.generate(PROMPTS, 1, SamplingParams(temperature=-1.0))
    with pytest.raises(EngineCallError, match="unknown weight name"):
        child.update_weights([("nope.weight", torch.zeros(1))])
    assert child.health_check()


def test_child_killed_during_generation_then_restart(pair):
    reference, child = pair
    pid = child.pid
    killer = threading.Timer(1.0, os.kill, args=(pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(EngineDiedError, match=r"died during generate \(exit code -9\)"):
            child.generate(PROMPTS, 2, LONG)
    finally:
        killer.cancel()
    assert not child.health_check()
    with pytest.raises(EngineDiedError, match="not running"):
        child.update_weights([])
    child.restart()
    assert child.health_check() and child.pid != pid and child.restarts == 1
    sync(child, reference)  # a fresh child has fresh weights: the caller re-syncs
    assert ids(child.generate(PROMPTS, 3, PARAMS)) == ids(reference.generate(PROMPTS, 3, PARAMS))


def test_child_killed_between_calls_is_detected_on_weight_sync(pair):
    reference, child = pair
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(EngineDiedError, match="died"):
        sync(child, reference)
    child.restart()
    sync(child, reference)
    assert child.weight_checksums(["model.norm.weight"]) == reference.weight_checksums(["model.norm.weight"])


def test_a_call_past_its_timeout_kills_the_child(pair):
    _, child = pair
    child.call_timeout_s = 1.0
    try:
        with pytest.raises(EngineDiedError, match="did not answer generate within 1.0s"):
            child.generate(PROMPTS, 1, LONG)
    finally:
        child.call_timeout_s = 120
    assert not child.health_check()
    child.restart()
    assert child.health_check()


def _failing_factory():
    raise RuntimeError("cannot build this engine")


def test_factory_error_is_reported():
    with pytest.raises(EngineDiedError, match="(?s)failed to start.*cannot build this engine"):
        SubprocessRolloutEngine(_failing_factory)
