"""The CPU server's ``/pause_generation`` modes, ``/continue_generation`` and weight updates between
tokens, through HTTP as a trainer drives sglang 0.5.23 (``gspo_megatron/cpu_server/pause.py``).

One tp-1 engine (the tiny qwen3_moe, fp32). A long request runs in a thread; the test pauses it after
a few tokens (the test-only ``/cpu_server/requests`` says how many), updates the weights while paused,
continues, and checks the answer: per-token weight versions (``meta_info.weight_versions``) split
exactly at the pause, and each token's log-prob equals a reference forward of the weights that
sampled it (in place: the old weights' KV cache for the prefix; retract: the prefix prefilled again
under the new weights), plus sglang's refusals.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from cpu_server_util import CpuServer
from gspo_megatron.cpu_server.pause import STEP_SLEEP_ENV
from gspo_megatron.engines.hf_engine import HFCheckpointLayout
from gspo_megatron.weight_sync.cuda_ipc import serialize_bucket

PROMPT = [5, 17, 42, 9]
N = 120  # max_new_tokens of the long request (2.4 s at the fixture's 20 ms per iteration)
FLUSH_REFUSED = "Weights were updated, but the cache was not flushed because requests are still running or queued."


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    # 20 ms per scheduler iteration: a pause lands within a few tokens even on a loaded machine
    s = CpuServer(model_dir, str(tmp_path_factory.mktemp("logs")), tp=1, node_env={0: {STEP_SLEEP_ENV: "0.02"}})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def weights(saved):
    """The engine's current weights and version, carried from test to test."""
    return {"state": dict(saved), "version": "default"}


def http(url, path, body=None, method="POST", timeout=300):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


class Call(threading.Thread):
    """One HTTP call in a thread: ``.result`` (status, body) once done."""

    def __init__(self, url, path, body):
        super().__init__(daemon=True)
        self.args, self.result = (url, path, body), None

    def run(self):
        self.result = http(*self.args)
        self.done_at = time.monotonic()


def long_request(url, n=N):
    call = Call(
        url,
        "/generate",
        {
            "input_ids": PROMPT,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": n, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    call.start()
    return call


def live(url):
    return http(url, "/cpu_server/requests", method="GET")[1]


def wait_tokens(url, k, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reqs = live(url)["requests"]
        if reqs and reqs[0]["output_len"] >= k:
            return
        time.sleep(0.01)
    raise TimeoutError(f"no request reached {k} tokens: {live(url)}")


def perturbed(saved, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in saved.items()}


def update(url, state, version, flush_cache=True):
    """begin / update_weights_from_tensor / end, as the trainer's tensor transport; the update's answer."""
    assert http(url, "/begin_weight_update", {})[0] == 200
    bucket = sorted(state.items())
    payload = serialize_bucket(bucket)
    out = http(
        url,
        "/update_weights_from_tensor",
        {
            "serialized_named_tensors": payload,
            "load_format": "flattened_bucket",
            "weight_version": version,
            "flush_cache": flush_cache,
        },
    )
    assert http(url, "/end_weight_update", {})[0] == 200
    del bucket
    return out


def model_of(model_dir, state):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load(model, state)
    return model


def load(model, state):
    layout = HFCheckpointLayout(model)
    for n, t in state.items():
        layout.load(n, t)


def logprobs(model, ids, start, cache=None):
    """log_softmax of ids[start + 1 :] given everything before, feeding ids[start:-1] (KV of ids[:start]
    in ``cache``)."""
    x = torch.tensor([ids[start:-1]])
    pos = torch.arange(start, len(ids) - 1)[None]
    with torch.no_grad():
        out = model(input_ids=x, position_ids=pos, past_key_values=cache, use_cache=cache is not None)
    lp = torch.log_softmax(out.logits[0].float(), -1)
    return lp.gather(-1, torch.tensor(ids[start + 1 :])[:, None])[:, 0]


def got_logprobs(meta):
    return torch.tensor([e[0] for e in meta["output_token_logprobs"]])


def spans(*parts):
    out, start = [], 0
    for version, end in parts:
        out.append({"version": version, "start": start, "end": end})
        start = end
    return out


def test_in_place_keeps_kv_and_refuses_flush(server, weights, model_dir):
    url, old = server.url, weights["state"]
    call = long_request(url)
    wait_tokens(url, 6)
    assert http(url, "/pause_generation", {"mode": "in_place"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    (req,) = live(url)["requests"]
    assert req["state"] == "running" and req["kv"]
    k = req["output_len"]
    time.sleep(0.3)
    assert live(url)["requests"][0]["output_len"] == k  # paused: no token
    # sglang: in_place keeps the running batch, so a flush is refused ...
    assert http(url, "/flush_cache") == (400, "Flush cache failed.\n")
    # ... and an update's default flush_cache=True fails the call after loading the weights
    new = perturbed(old, 1)
    status, body = update(url, new, "v1")
    assert status == 400 and body["message"].startswith(FLUSH_REFUSED), body
    assert http(url, "/get_model_info", method="GET")[1]["weight_version"] == weights["version"]  # not on failure
    assert http(url, "/continue_generation", {})[0] == 200
    call.join(300)
    status, out = call.result
    assert status == 200, out
    meta, ids = out["meta_info"], out["output_ids"]
    assert len(ids) == N and meta["finish_reason"] == {"type": "length", "length": N}
    # the scheduler recorded the change: tokens sampled after the update carry v1
    assert meta["weight_versions"] == spans((weights["version"], k), ("v1", N))
    assert meta["weight_version"] == "v1" and meta["num_retractions"] == 0
    # log-probs: tokens < k from the old weights; the rest from the new weights over the old KV cache
    seq = PROMPT + ids
    p = len(PROMPT)
    model = model_of(model_dir, old)
    ref_old = logprobs(model, seq, 0)[p - 1 :]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([seq[: p + k - 1]]), past_key_values=cache, use_cache=True)
    load(model, new)
    ref_new = logprobs(model, seq, p + k - 1, cache)
    got = got_logprobs(meta)
    assert torch.allclose(got[:k], ref_old[:k], atol=1e-5, rtol=0)
    assert torch.allclose(got[k:], ref_new, atol=1e-5, rtol=0)
    # and not the log-probs of a full re-prefill under the new weights (the KV was kept)
    assert not torch.allclose(got[k:], logprobs(model_of(model_dir, new), seq, 0)[p - 1 + k :], atol=1e-5)
    weights.update(state=new, version="v1")


def test_retract_recomputes_the_prefix_under_new_weights(server, weights, model_dir):
    url, old, v_old = server.url, weights["state"], weights["version"]
    call = long_request(url)
    wait_tokens(url, 6)
    assert http(url, "/pause_generation", {"mode": "retract"})[0] == 200
    (req,) = live(url)["requests"]
    assert req["state"] == "waiting" and not req["kv"] and req["retractions"] == 1
    k = req["output_len"]
    assert http(url, "/flush_cache")[0] == 200  # retract: the running batch is empty, waiting ignored
    new = perturbed(old, 2)
    status, body = update(url, new, "v2")  # the default flush succeeds
    assert status == 200 and body["success"], body
    assert http(url, "/get_model_info", method="GET")[1]["weight_version"] == "v2"
    assert http(url, "/continue_generation", {})[0] == 200
    call.join(300)
    status, out = call.result
    assert status == 200, out
    meta, ids = out["meta_info"], out["output_ids"]
    assert len(ids) == N and meta["num_retractions"] == 1
    assert meta["weight_versions"] == spans((v_old, k), ("v2", N)) and meta["weight_version"] == "v2"
    seq, p = PROMPT + ids, len(PROMPT)
    got = got_logprobs(meta)
    assert torch.allclose(got[:k], logprobs(model_of(model_dir, old), seq, 0)[p - 1 : p - 1 + k], atol=1e-5, rtol=0)
    # the prefix (prompt + k tokens) prefilled again under v2: a plain forward of v2 from token k on
    assert torch.allclose(got[k:], logprobs(model_of(model_dir, new), seq, 0)[p - 1 + k :], atol=1e-5, rtol=0)
    weights.update(state=new, version="v2")


def test_abort_returns_partial_output_and_holds_new_requests(server, weights, model_dir):
    url = server.url
    call = long_request(url, n=N)
    wait_tokens(url, 4)
    t0 = time.monotonic()
    assert http(url, "/pause_generation", {})[0] == 200  # mode "abort" by default
    assert time.monotonic() - t0 >= 0.9  # sglang polls its abort every 1.0 s while /generate runs
    call.join(60)
    status, out = call.result
    meta, ids = out["meta_info"], out["output_ids"]
    # sglang FINISH_ABORT(): HTTP 200, the partial output (one more decode after the abort)
    assert status == 200 and 4 < len(ids) < N
    assert meta["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert meta["completion_tokens"] == len(ids) and meta["num_retractions"] == 0
    assert meta["weight_versions"] == spans((weights["version"], len(ids)))
    seq, p = PROMPT + ids, len(PROMPT)
    ref = logprobs(model_of(model_dir, weights["state"]), seq, 0)[p - 1 :]
    assert torch.allclose(got_logprobs(meta), ref, atol=1e-5, rtol=0)
    assert live(url)["requests"] == []
    # paused: a new /generate waits (it is not refused) until continue
    waiting = long_request(url, n=3)
    time.sleep(0.5)
    assert waiting.is_alive() and live(url)["requests"] == []
    # an update while paused runs at once; nothing runs, so its flush succeeds
    new = perturbed(weights["state"], 3)
    status, body = update(url, new, "v3")
    assert status == 200, body
    assert http(url, "/continue_generation", {})[0] == 200
    waiting.join(60)
    status, out = waiting.result
    assert status == 200 and out["meta_info"]["weight_versions"] == spans(("v3", 3))
    weights.update(state=new, version="v3")


def test_abort_of_a_retracted_request_answers_from_the_waiting_queue(server, weights):
    url = server.url
    call = long_request(url, n=N)
    wait_tokens(url, 3)
    assert http(url, "/pause_generation", {"mode": "retract"})[0] == 200
    k = live(url)["requests"][0]["output_len"]
    assert k < 50
    assert http(url, "/pause_generation", {"mode": "abort"})[0] == 200
    call.join(60)
    status, out = call.result
    meta = out["meta_info"]
    # tokenizer_manager._handle_abort_req: what the tokenizer holds of a non-streaming request
    # (tokens arrive every SGLANG_FORCE_STREAM_INTERVAL = 50): none of the k < 50 here
    assert status == 200 and out["output_ids"] == []
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    assert meta["weight_versions"] == spans((weights["version"], 0)) and "prompt_tokens" not in meta
    assert http(url, "/continue_generation", {})[0] == 200


def test_update_without_pause_waits_for_running_requests(server, weights):
    """Not paused, an update call takes the writer side of model_update_lock: it waits until every
    /generate in flight has answered, so that request sees one version."""
    url = server.url
    call = long_request(url, n=N)
    wait_tokens(url, 2)
    begin = Call(url, "/begin_weight_update", {})
    begin.start()
    time.sleep(0.3)
    assert begin.is_alive() and call.is_alive()
    call.join(120)
    begin.join(60)
    # the server answers the /generate first; the two client threads then read their answers in
    # either order (seen: the update's thread first by 0.4 ms), so the clocks get 50 ms of slack,
    # far below the request's remaining decode steps had the update not waited
    assert begin.result[0] == 200 and call.done_at <= begin.done_at + 0.05
    new = perturbed(weights["state"], 4)
    payload = serialize_bucket(sorted(new.items()))
    body = {"serialized_named_tensors": payload, "load_format": "flattened_bucket", "weight_version": "v4"}
    assert http(url, "/update_weights_from_tensor", body)[0] == 200
    assert http(url, "/end_weight_update", {})[0] == 200
    status, out = call.result
    assert status == 200 and out["meta_info"]["weight_versions"] == spans((weights["version"], N))
    weights.update(state=new, version="v4")


def test_bad_mode_is_fastapis_422(server):
    status, body = http(server.url, "/pause_generation", {"mode": "later"})
    assert status == 422 and body["detail"][0]["type"] == "literal_error"
    assert body["detail"][0]["loc"] == ["body", "mode"]
