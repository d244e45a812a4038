"""The CPU server's DSA indexer selection over HTTP (sglang 0.5.23's ``--enable-return-indexer-topk``,
request field ``return_indexer_topk``, ``meta_info["indexer_topk"]``: base64 int32 [seqlen - 1, layers,
index_topk]): the payload decodes (``decode_indexer_topk``) and equals the in-process engine's selection
(``HFRolloutEngine`` with an ``IndexerRecorder``) for the same batch; a request not asking gets no key;
the SGLang engine client decodes it into ``RolloutSample.indexer_topk``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpu_server_util import CpuServer
from gspo_megatron.cpu_server.routes import IndexerRecorder, RouteRecorder
from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.hf_engine import HFRolloutEngine
from gspo_megatron.engines.routing import (
    INDEXER_META_KEY,
    RoutedExpertsError,
    decode_indexer_topk,
    route_spec_of,
    route_tokens,
)
from gspo_megatron.engines.sglang_engine import SGLangRolloutEngine

# one indexer head and a small top-k: many exact-zero ties, sequences longer than index_topk
TIES = dict(index_n_heads=1, index_topk=4)
PROMPTS = [[5, 17, 42, 9, 33, 2, 8], [100, 3]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    out = str(tmp_path_factory.mktemp("tiny_deepseek_v32"))
    save_tiny_hf_model("deepseek_v32", out, seed=7, **TIES)
    return out


@pytest.fixture(scope="module")
def spec(dsa_dir):
    import json
    import os

    with open(os.path.join(dsa_dir, "config.json")) as f:
        s = route_spec_of(json.load(f))
    assert s.index_topk == TIES["index_topk"], s
    return s


def in_process(dsa_dir, prompts, params=GREEDY):
    """The in-process engine's samples, one unpadded prompt per forward (as the server runs each request:
    its own forward and KV cache, ``cpu_server/scheduler.py``; the ties this config creates on purpose
    break the same way only without left padding)."""
    engine = HFRolloutEngine(dsa_dir, dsa_dir)
    return [
        engine._generate_batch(
            [p], params, torch.Generator().manual_seed(0), RouteRecorder(engine.model), IndexerRecorder(engine.model)
        )[0]
        for p in prompts
    ]


@pytest.fixture(scope="module")
def server(dsa_dir, tmp_path_factory):
    s = CpuServer(
        dsa_dir,
        str(tmp_path_factory.mktemp("logs")),
        tp=1,
        extra=("--enable-return-routed-experts", "--enable-return-indexer-topk"),
    )
    yield s
    s.stop()


def test_http_indexer_topk_as_sglang(server, dsa_dir, spec):
    out = server.client.post(
        "generate",
        {
            "input_ids": PROMPTS,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
            "return_indexer_topk": True,
        },
    )
    assert isinstance(out, list) and len(out) == len(PROMPTS)
    ref = in_process(dsa_dir, PROMPTS)
    for prompt, o, r in zip(PROMPTS, out, ref):
        assert o["output_ids"] == r.response_ids
        payload = o["meta_info"][INDEXER_META_KEY]
        assert isinstance(payload, str)
        n = route_tokens(len(prompt), len(o["output_ids"]))
        assert n > TIES["index_topk"]  # rows with a real choice among the keys
        sel = decode_indexer_topk(payload, num_tokens=n, num_layers=spec.num_layers, index_topk=spec.index_topk)
        np.testing.assert_array_equal(sel, r.indexer_topk)
        assert "routed_experts" not in o["meta_info"]  # not asked
    # not asked: no key (sglang's capturer only fills requests that asked)
    plain = server.client.post("generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert INDEXER_META_KEY not in plain["meta_info"]


def test_engine_client_decodes_indexer_topk(server, dsa_dir, spec):
    engine = SGLangRolloutEngine([server.client], route_spec=spec)
    groups = engine.generate(PROMPTS, 2, GREEDY)
    for prompt, group in zip(PROMPTS, groups):
        ref = in_process(dsa_dir, [prompt, prompt])  # the group's n samples, each its own request
        for s, r in zip(group, ref):
            n = len(s.prompt_ids) + len(s.response_ids) - 1
            assert s.response_ids == r.response_ids
            assert s.indexer_topk.dtype == np.int32
            assert s.indexer_topk.shape == (n, spec.num_layers, spec.index_topk)
            np.testing.assert_array_equal(s.indexer_topk, r.indexer_topk)
            assert s.routed_experts.shape == (n, spec.num_layers, spec.topk)
            np.testing.assert_array_equal(s.routed_experts, r.routed_experts)
    # a spec whose index_topk does not fit the model: one clear error naming the engine
    wrong = SGLangRolloutEngine(
        [server.client], route_spec=type(spec)(spec.num_layers, spec.topk, spec.num_experts, spec.index_topk + 1)
    )
    with pytest.raises(RoutedExpertsError, match=server.url):
        wrong.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=2))


def test_indexer_capture_at_tp_above_one_aborts_the_start_as_sglangs_capturer(dsa_dir, tmp_path):
    """sglang's IndexerTopkCapturer asserts attn_tp_size == 1 when it is built (the model runner's
    start): an engine at --tp-size 2 without attention DP never comes up; nor does the CPU server."""
    from gspo_megatron.fleet.engine_startup_checks import INDEXER_CAPTURER_ASSERT

    with pytest.raises(Exception):  # noqa: B017 - the start fails; the log names sglang's assert
        CpuServer(dsa_dir, str(tmp_path), tp=2, extra=("--enable-return-indexer-topk",))
    logs = "".join(p.read_text() for p in tmp_path.glob("cpu_server_*_node0.log"))
    assert INDEXER_CAPTURER_ASSERT in logs and "attn_tp_size = 2" in logs
