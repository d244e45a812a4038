"""The rollout hook runs unchanged on the other engine kinds: the engine subprocess and SGLang's
HTTP API (served by the CPU stand-in server). Same checks as test_custom_rollout.py: the loss mask is
exactly the engine-sampled tokens, their ids and log-probs are the engine's. Starts processes: run
under the heavy-test lock."""

import os
import sys

import pytest
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

sys.path.insert(0, os.path.dirname(__file__))

from cpu_server_util import CpuServer
from gspo_megatron.data.tokenizer import build_demo_tokenizer
from gspo_megatron.engines.hf_engine import HFRolloutEngine
from gspo_megatron.engines.sglang_engine import SGLangRolloutEngine
from gspo_megatron.engines.subprocess_engine import SubprocessRolloutEngine
from test_custom_rollout import (
    ENGINE_CONFIG,
    RecordingEngine,
    _cfg,
    _collect,
    _expected_mask,
    _forced_calls_hook,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("model")
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(**ENGINE_CONFIG)).save_pretrained(d)
    build_demo_tokenizer(d)
    return str(d)


def _check(engine, tmp_path):
    tok = build_demo_tokenizer()
    rec = RecordingEngine(engine)
    batch = _collect(_cfg(_forced_calls_hook(tmp_path, tok)), rec, tok)
    for r in batch.records:
        mask, turns = _expected_mask(r, rec.calls)
        assert len(turns) == 3 and r.loss_mask == mask and 0 < sum(mask) < len(mask)
    assert rec.engine_calls == 3  # 24 samples x 3 turns in 3 batched engine calls


def test_hook_on_the_engine_subprocess(model_dir, tmp_path):
    engine = SubprocessRolloutEngine(HFRolloutEngine, dict(config=model_dir, weights=model_dir, seed=1))
    try:
        _check(engine, tmp_path)
    finally:
        engine.shutdown()


def test_hook_on_sglang_http_api(model_dir, tmp_path):
    server = CpuServer(model_dir, str(tmp_path))
    try:
        _check(SGLangRolloutEngine.attach([server.url]), tmp_path)
    finally:
        server.stop()
