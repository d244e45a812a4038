"""Speculative requests pause, update and retract between draft-verify cycles, as sglang 0.5.23's EAGLE
worker does between decode steps (``cpu_server/scheduler.py``: one cycle per scheduler iteration), through
HTTP as the trainer's in-flight updates drive it (``rollout.inflight_updates`` with ``rollout.speculative``).

One tp-1 speculative engine (the tiny GLM-4.5 with its MTP layer, fp32). A long sampled request runs in a
thread; the test pauses it after a few tokens, well before its end, updates the target's weights and
continues. Checked: the pause lands mid-request (no token while paused), the per-token weight versions
split exactly there, and every token's log-prob is the target's of the weights that sampled it (in place:
the new weights over the old KV cache; retract: the prefix prefilled again under the new weights), the
acceptance counts running on across the pause."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache

from cpu_server_util import CpuServer
from gspo_megatron.cpu_server.pause import STEP_SLEEP_ENV
from mtp_util import write_mtp_checkpoint
from test_cpu_server_pause import PROMPT, got_logprobs, http, live, load, logprobs, model_of, spans, update, wait_tokens

N = 60  # max_new_tokens of the long request
STEPS = 2


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    """(hf dir, the target's tensors, the MTP layer's tensors, the server)."""
    from safetensors.torch import load_file

    d = str(tmp_path_factory.mktemp("glm_mtp"))
    _, _, mtp = write_mtp_checkpoint(d, "glm4_moe", seed=3)
    target = {n: t for n, t in load_file(f"{d}/model.safetensors").items() if n not in mtp}
    extra = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(STEPS))
    srv = CpuServer(d, str(tmp_path_factory.mktemp("logs")), tp=1, extra=extra, node_env={0: {STEP_SLEEP_ENV: "0.02"}})
    yield d, target, mtp, srv
    srv.stop()


def _long_request(url):
    from test_cpu_server_pause import Call

    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": N, "ignore_eos": True},
        "return_logprob": True,
    }
    call = Call(url, "/generate", body)
    call.start()
    return call


def _perturbed(state, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in state.items()}


def _paused(url, mode: str):
    """A long request paused in ``mode`` after a few tokens: (its call, its request row, its tokens k)."""
    call = _long_request(url)
    wait_tokens(url, 4)
    assert http(url, "/pause_generation", {"mode": mode})[0] == 200
    (req,) = live(url)["requests"]
    k = req["output_len"]
    time.sleep(0.3)
    assert live(url)["requests"][0]["output_len"] == k  # paused between cycles: no token
    assert 0 < k < N - STEPS - 1, k  # mid-request, not at its end
    return call, req, k


def _finished(call) -> tuple[dict, list[int]]:
    call.join(300)
    status, out = call.result
    assert status == 200, out
    meta = out["meta_info"]
    assert len(out["output_ids"]) == N and meta["finish_reason"] == {"type": "length", "length": N}
    assert meta["spec_verify_ct"] >= 1 and meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"] * STEPS
    return meta, out["output_ids"]


def test_in_place_pause_lands_between_cycles_and_new_weights_verify_over_the_old_cache(spec):
    d, old, mtp, srv = spec
    url = srv.url
    call, req, k = _paused(url, "in_place")
    assert req["state"] == "running" and req["kv"]  # in place: the speculative request keeps its KV cache
    new = _perturbed(old, 1)
    status, body = update(url, {**new, **mtp}, "v1", flush_cache=False)
    assert status == 200 and body["success"], body
    assert http(url, "/continue_generation", {})[0] == 200
    meta, ids = _finished(call)
    assert meta["weight_versions"] == spans(("default", k), ("v1", N)) and meta["num_retractions"] == 0
    seq, p = PROMPT + ids, len(PROMPT)
    model = model_of(d, old)
    got = got_logprobs(meta)
    assert torch.allclose(got[:k], logprobs(model, seq, 0)[p - 1 : p - 1 + k], atol=1e-5, rtol=0)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([seq[: p + k - 1]]), past_key_values=cache, use_cache=True)
    load(model, new)
    assert torch.allclose(got[k:], logprobs(model, seq, p + k - 1, cache), atol=1e-5, rtol=0)
    assert http(url, "/flush_cache")[0] == 200
    assert update(url, {**old, **mtp}, "default")[0] == 200  # back to the checkpoint for the next test


def test_retract_prefills_the_prefix_again_under_new_weights(spec):
    d, old, mtp, srv = spec
    url = srv.url
    call, req, k = _paused(url, "retract")
    assert req["state"] == "waiting" and not req["kv"] and req["retractions"] == 1
    new = _perturbed(old, 2)
    status, body = update(url, {**new, **mtp}, "v2")
    assert status == 200 and body["success"], body
    assert http(url, "/continue_generation", {})[0] == 200
    meta, ids = _finished(call)
    assert meta["weight_versions"] == spans(("default", k), ("v2", N)) and meta["num_retractions"] == 1
    seq, p = PROMPT + ids, len(PROMPT)
    got = got_logprobs(meta)
    assert torch.allclose(got[:k], logprobs(model_of(d, old), seq, 0)[p - 1 : p - 1 + k], atol=1e-5, rtol=0)
    assert torch.allclose(got[k:], logprobs(model_of(d, new), seq, 0)[p - 1 + k :], atol=1e-5, rtol=0)
