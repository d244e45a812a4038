"""The CPU server's routed experts (sglang 0.5.23's flag, request field, meta_info key and encoding),
decoded by the SGLang engine client, checked against transformers' own router on the full sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from cpu_server_util import CpuServer
from gspo_megatron.cpu_server.routes import RouteRecorder
from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.hf_engine import HFRolloutEngine
from gspo_megatron.engines.routing import RoutedExpertsError, RouteSpec, decode_routed_experts, route_tokens
from gspo_megatron.engines.sglang_engine import SGLangRolloutEngine

PROMPTS = [[5, 17, 42, 9], [100, 3]]
PERTURB = 3.0


@pytest.fixture(scope="module")
def config(model_dir):
    return AutoConfig.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def spec(config):
    return RouteSpec(config.num_hidden_layers, config.num_experts_per_tok, config.num_experts)


def full_routes(model_dir, tokens, perturb=0.0):
    """transformers' routes of one unpadded, uncached forward of ``tokens``: [len, layers, topk]."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rec = RouteRecorder(model, perturb)
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    return rec.take(1, len(tokens))[0].numpy()


def test_engine_routes_are_prefill_then_decode(model_dir):
    """Left-padded batch with a KV cache: each sample's routes equal the full forward's over
    [0, seqlen - 1); a route shifted by one token does not."""
    engine = HFRolloutEngine(model_dir, model_dir)
    rec = RouteRecorder(engine.model)
    out = engine._generate_batch(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=5), engine._generator, rec)
    for s in out:
        tokens = s.prompt_ids + s.response_ids
        ref = full_routes(model_dir, tokens)
        assert s.routed_experts.dtype == np.int32
        assert s.routed_experts.shape == (route_tokens(len(s.prompt_ids), len(s.response_ids)),) + ref.shape[1:]
        np.testing.assert_array_equal(np.sort(s.routed_experts, -1), np.sort(ref[:-1], -1))
        assert not np.array_equal(np.sort(s.routed_experts[1:], -1), np.sort(ref[:-2], -1))  # shift is seen


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = CpuServer(
        model_dir,
        str(tmp_path_factory.mktemp("logs")),
        tp=1,
        extra=("--enable-return-routed-experts", "--router-logit-perturbation", str(PERTURB)),
    )
    yield s
    s.stop()


def test_http_routes_as_sglang(server, model_dir, spec):
    out = server.client.post(
        "generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 4},
            "return_routed_experts": True,
            "routed_experts_start_len": 2,
        },
    )
    n_out = len(out["output_ids"])
    payload = out["meta_info"]["routed_experts"]
    assert isinstance(payload, str)
    routes = decode_routed_experts(
        payload,
        num_tokens=route_tokens(4, n_out, 2),
        num_layers=spec.num_layers,
        topk=spec.topk,
        num_experts=spec.num_experts,
    )
    ref = full_routes(model_dir, PROMPTS[0] + out["output_ids"], PERTURB)
    np.testing.assert_array_equal(np.sort(routes, -1), np.sort(ref[2:-1], -1))
    # not asked: no routes (sglang's capturer only fills requests that asked)
    plain = server.client.post("generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}})
    assert "routed_experts" not in plain["meta_info"]
    # sglang's scheduler check of the start
    with pytest.raises(Exception, match="routed_experts_start_len=5 is higher"):
        server.client.post(
            "generate", {"input_ids": PROMPTS[0], "return_routed_experts": True, "routed_experts_start_len": 5}
        )


def test_engine_client_decodes_and_validates(server, model_dir, spec, config):
    engine = SGLangRolloutEngine([server.client], route_spec=spec)
    groups = engine.generate(PROMPTS, 2, SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))
    unperturbed_agree = []
    for group in groups:
        for s in group:
            tokens = s.prompt_ids + s.response_ids
            assert s.routed_experts.shape == (len(tokens) - 1, spec.num_layers, spec.topk)
            np.testing.assert_array_equal(
                np.sort(s.routed_experts, -1), np.sort(full_routes(model_dir, tokens, PERTURB)[:-1], -1)
            )
            plain = np.sort(full_routes(model_dir, tokens)[:-1], -1)
            unperturbed_agree.append((np.sort(s.routed_experts, -1) == plain).all(-1).mean())
    assert np.mean(unperturbed_agree) < 0.95  # the perturbation really changes the engine's routing
    # a model with other dims: one clear error naming the engine
    wrong = SGLangRolloutEngine([server.client], route_spec=RouteSpec(spec.num_layers + 1, spec.topk, spec.num_experts))
    with pytest.raises(RoutedExpertsError, match=server.url):
        wrong.generate(PROMPTS[:1], 1, SamplingParams(max_new_tokens=2))
