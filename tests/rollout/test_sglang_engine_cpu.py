"""CPU tests of the SGLang rollout engine's engine-independent logic: request building, output
parsing, sample grouping/seeding over several engines, the sync bracket, and the HTTP client
against a local stand-in server speaking SGLang's routes."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gspo_megatron.engines.base import SamplingParams
from gspo_megatron.engines.sglang_client import SGLangError, SGLangHttpClient
from gspo_megatron.engines.sglang_engine import (
    SGLangRolloutEngine,
    parse_output,
    server_args_to_cli,
    to_sglang_sampling_params,
)


def _out(ids, logps, kind="length"):
    return {
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": kind},
            "output_token_logprobs": [[lp, i, None] for lp, i in zip(logps, ids)],
        },
    }


def test_cli_and_sampling_params():
    assert server_args_to_cli(
        {"model_path": "/m", "tp_size": 2, "enable_memory_saver": True, "x": False, "y": None, "cuda_graph_bs": [1, 2]}
    ) == ["--model-path", "/m", "--tp-size", "2", "--enable-memory-saver", "--cuda-graph-bs", "1", "2"]
    sp = to_sglang_sampling_params(
        SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=5, stop_token_ids=[2]), seed=11
    )
    assert sp == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_new_tokens": 5,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "stop_token_ids": [2],
        "sampling_seed": 11,
    }
    assert "sampling_seed" not in to_sglang_sampling_params(SamplingParams(), None)


def test_parse_output():
    s = parse_output([1, 2], _out([5, 2], [-0.5, -1.5], "stop"))
    assert (s.prompt_ids, s.response_ids, s.response_logprobs, s.finish_reason) == (
        [1, 2],
        [5, 2],
        [-0.5, -1.5],
        "stop",
    )
    bad = _out([5, 2], [-0.5, -1.5])
    bad["output_ids"] = [5, 3]
    with pytest.raises(SGLangError, match="disagree"):
        parse_output([1], bad)
    with pytest.raises(SGLangError, match="abort"):
        parse_output([1], _out([5], [-1.0], "abort"))
    with pytest.raises(SGLangError, match="output_token_logprobs"):
        parse_output([1], {"meta_info": {"finish_reason": {"type": "stop"}}})


class FakeClient:
    def __init__(self, name):
        self.name, self.requests, self.calls, self.batched = name, [], [], []

    def generate(self, input_ids, sampling_params, return_logprob=True, batch=True):
        assert return_logprob
        self.requests.append((input_ids, sampling_params))
        self.batched.append(batch)
        # response encodes (engine, seed) so the test can check routing and order
        return [
            _out([100 + sp.get("sampling_seed", -100), 7 if self.name == "a" else 8], [-0.1, -0.2])
            for sp in sampling_params
        ]

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append(name)


def test_generate_groups_prompts_per_engine_and_seeds_samples():
    a, b = FakeClient("a"), FakeClient("b")
    eng = SGLangRolloutEngine([a, b], send_seeds=True)
    prompts = [[1, 2], [3], [4, 5, 6]]
    out = eng.generate(prompts, n=2, params=SamplingParams(seed=10, max_new_tokens=2))
    assert [len(g) for g in out] == [2, 2, 2]
    for i, group in enumerate(out):
        for j, s in enumerate(group):
            assert s.prompt_ids == prompts[i]
            assert s.response_ids[0] == 100 + 10 + i * 2 + j  # per-sample seed, order kept
            assert s.response_ids[1] == (7 if i % 2 == 0 else 8)  # prompt groups round-robin over engines
    assert [len(r[0]) for r in a.requests] == [2, 2] and [len(r[0]) for r in b.requests] == [2]
    with pytest.raises(ValueError, match="n must be"):
        eng.generate(prompts, n=0, params=SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[1], []], n=1, params=SamplingParams())
    # SGLang ignores sampling_seed unless the server runs deterministic inference: not sent then
    plain = SGLangRolloutEngine([FakeClient("a")])
    assert plain.generate([[1]], n=1, params=SamplingParams(seed=10))[0][0].response_ids[0] == 0
    # through the router every sample is its own request (its /generate takes one sampling-params object)
    router = FakeClient("a")
    routed = SGLangRolloutEngine([FakeClient("b")], router=router, send_seeds=True)
    assert [len(g) for g in routed.generate(prompts, n=2, params=SamplingParams(seed=10))] == [2, 2, 2]
    assert [len(r[0]) for r in router.requests] == [2, 2, 2] and router.batched == [False] * 3
    assert a.batched == [True, True]  # engines directly: one batched request per prompt group
    # the post-sync probe asks every engine, not a router
    each = SGLangRolloutEngine([a, b], router=FakeClient("router"))
    assert [[s.response_ids[1] for s in per] for per in each.generate_on_each([[1], [2]], SamplingParams())] == [
        [7, 7],
        [8, 8],
    ]


def test_sync_bracket_and_memory_calls():
    a = FakeClient("a")
    eng = SGLangRolloutEngine([a])
    eng.begin_weight_update()
    eng.end_weight_update()
    eng.release_memory()
    eng.resume_memory(["weights"])
    assert a.calls == [
        "pause_generation",
        "flush_cache",
        "begin_weight_update",
        "end_weight_update",
        "flush_cache",
        "continue_generation",
        "flush_cache",
        "release_memory_occupation",
        "resume_memory_occupation",
    ]
    with pytest.raises(NotImplementedError, match="through a transport"):
        eng.update_weights([])


class _Handler(BaseHTTPRequestHandler):
    routes: dict = {}
    seen: list = []

    def _reply(self, method):
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.seen.append((method, self.path, body))
        code, payload = self.routes.get(self.path, (404, {"detail": "Not Found"}))
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self._reply("POST")

    def do_GET(self):
        self._reply("GET")

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    _Handler.routes, _Handler.seen = {}, []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv, _Handler
    srv.shutdown()
    srv.server_close()


def test_http_client_against_sglang_routes(server):
    srv, h = server
    c = SGLangHttpClient(f"http://127.0.0.1:{srv.server_address[1]}")
    h.routes.update(
        {
            "/generate": (200, [_out([4, 2], [-1.0, -2.0], "stop")]),
            "/health_generate": (200, None),
            "/update_weights_from_tensor": (400, {"success": False, "message": "shape mismatch for q_proj"}),
            "/update_weights_from_distributed": (200, {"success": True, "message": "ok"}),
            "/get_weights_by_name": (200, [[0.5, 1.0]]),
            "/get_server_info": (200, {"tp_size": 4}),
        }
    )
    assert c.health() and c.tp_size == 4
    assert c.generate([[1, 2]], [{"max_new_tokens": 2}])[0]["output_ids"] == [4, 2]
    method, path, body = h.seen[-1]
    assert (method, path) == ("POST", "/generate") and body["input_ids"] == [[1, 2]] and body["return_logprob"]
    assert c.begin_weight_update() is False  # route missing: an SGLang without sessions
    c.end_weight_update()
    assert not any(p == "/end_weight_update" for _, p, _ in h.seen)
    with pytest.raises(SGLangError, match="update_weights_from_tensor.*shape mismatch for q_proj"):
        c.update_weights_from_tensor(["payload"], load_format="flattened_bucket")
    c.update_weights_from_distributed(["w"], ["bfloat16"], [(2, 3)], "g", weight_version="3")
    body = h.seen[-1][2]
    assert body == {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 3]],
        "group_name": "g",
        "flush_cache": False,
        "weight_version": "3",
    }
    assert c.get_weights_by_name("w", 1) == [[0.5, 1.0]]
    h.routes["/begin_weight_update"] = (200, {"success": True, "message": "Success"})
    h.routes["/end_weight_update"] = (200, {"success": True, "message": "Success"})
    c2 = SGLangHttpClient(c.base_url)
    assert c2.begin_weight_update() is True
    c2.end_weight_update()
    assert h.seen[-1][1] == "/end_weight_update"
    dead = SGLangHttpClient("http://127.0.0.1:9", timeout_s=2)
    assert dead.health(timeout_s=1) is False
    with pytest.raises(SGLangError, match="unreachable"):
        dead.flush_cache()
