"""The HTTP front of the CPU server (node rank 0 only): sglang 0.5.23's routes, request fields,
response fields and status codes (``srt/entrypoints/http_server.py``), answered by the TP workers.

Each route turns into commands for TP rank 0 (``worker``), sent over a pipe under a lock, so
commands run one at a time. ``/generate`` queues its requests on rank 0's scheduler and a driver
thread runs one scheduler iteration per command (``pause.py``), so pauses, aborts and weight updates
land between tokens; ``/pause_generation`` (modes ``abort`` / ``retract`` / ``in_place``),
``/continue_generation`` and the update lock follow sglang's tokenizer manager (``pause.py``; a
paused ``/health_generate`` answers 503 after sglang's 20 s health timeout). The test-only routes under ``/cpu_server/`` are not part of SGLang; the trainer never
calls them.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import urlparse

import torch

from gspo_megatron.cpu_server import prompt_logprobs
from gspo_megatron.cpu_server.args import ServerArgs
from gspo_megatron.cpu_server.pause import PausingFront, WorkerDied
from gspo_megatron.cpu_server.speculative import selector_refusal, spec_meta_info
from gspo_megatron.dtypes import dtype_name, torch_dtype
from gspo_megatron.engines.routing import INDEXER_META_KEY, INDEXER_REQUEST_FLAG, encode_routed_experts
from gspo_megatron.engines.sglang_compat import SGLANG_VERSION_TESTED

HEALTH_CHECK_TIMEOUT = 20.0  # sglang HEALTH_CHECK_TIMEOUT


class Front(PausingFront):
    """Route logic, independent of the HTTP plumbing: ``call(method, path, body) -> (status, payload)``
    where payload is a JSON-able object, or ``str`` for a plain-text body."""

    def __init__(self, args: ServerArgs, conn: Any, on_worker_death: Callable[[], None]):
        self.args, self.conn, self.on_worker_death = args, conn, on_worker_death
        self.lock = threading.Lock()
        self.paused = False
        self.pause_cond = threading.Condition()
        self.weight_version = "default"
        self.startup_time = time.time()
        from gspo_megatron.cpu_server.lora import FrontLoras

        self.loras = FrontLoras(args)  # the tokenizer manager's LoRA registry (cpu_server/lora.py)
        self.routes: dict[str, tuple[tuple[str, ...], Callable[[dict], tuple[int, Any]]]] = {
            "/generate": (("POST", "PUT"), self.generate),
            "/health": (("GET",), self.health),
            "/health_generate": (("GET",), self.health_generate),
            "/get_server_info": (("GET",), self.server_info),
            "/server_info": (("GET",), self.server_info),
            "/get_model_info": (("GET",), self.model_info),
            "/model_info": (("GET",), self.model_info),
            "/flush_cache": (("GET", "POST"), self.flush_cache),
            "/pause_generation": (("POST",), self.pause_generation),
            "/continue_generation": (("POST",), self.continue_generation),
            "/begin_weight_update": (("POST",), self.begin_weight_update),
            "/end_weight_update": (("POST",), lambda b: self.locked_update(lambda: self.weight_call("end", {}, b))),
            "/init_weights_update_group": (("POST",), self.init_group),
            "/destroy_weights_update_group": (("POST",), self.destroy_group),
            "/update_weights_from_distributed": (("POST",), self.update_distributed),
            "/update_weights_from_tensor": (("POST",), self.update_tensor),
            "/update_weight_version": (("POST",), self.update_weight_version),
            "/get_weights_by_name": (("GET", "POST"), self.get_weights_by_name),
            "/release_memory_occupation": (("GET", "POST"), lambda b: self.memory("release", b)),
            "/resume_memory_occupation": (("GET", "POST"), lambda b: self.memory("resume", b)),
            "/load_lora_adapter_from_tensors": (("POST",), self.load_lora_from_tensors),
            "/load_lora_adapter": (("POST",), self.load_lora_from_path),
            "/unload_lora_adapter": (("POST",), self.unload_lora),
            "/cpu_server/weight_shards": (("POST",), self.weight_shards),
            "/cpu_server/memory": (("GET",), self.memory_report),
            "/cpu_server/requests": (("GET",), self.requests_report),
        }
        self._init_scheduling()

    # -- plumbing --------------------------------------------------------------------------------
    def command(self, op: str, _with_version: bool = False, _new_version: Any = None, **kw: Any) -> Any:
        """Run one worker command. ``_with_version``: return (result, the weight version it ran
        under). ``_new_version``: a weight update's version, taking effect (on success) under the
        command lock, so that no generation after the update reports the old version."""
        control = op != "step"
        if control:  # the driver lets it in before its next iteration (PausingFront._drive)
            with self.work:
                self.control_waiting += 1
        with self.lock:
            if control:
                with self.work:
                    self.control_waiting -= 1
                    self.work.notify_all()
            try:
                self.conn.send((op, kw))
                result = self.conn.recv()
                self.absorb(result)
                if _new_version is not None and result["success"]:
                    self.weight_version = str(_new_version)
                return (result, self.weight_version) if _with_version else result
            except (EOFError, OSError) as e:
                self.on_worker_death()
                raise WorkerDied(f"TP rank 0 is gone ({e})") from e

    def call(self, method: str, path: str, body: dict | None) -> tuple[int, Any]:
        route = self.routes.get(path)
        if route is None:
            return 404, {"detail": "Not Found"}
        if method not in route[0]:
            return 405, {"detail": "Method Not Allowed"}
        try:
            return route[1](body or {})
        except _Missing as e:
            return 422, {"detail": [{"type": "missing", "loc": ["body", str(e)], "msg": "Field required"}]}
        except WorkerDied as e:
            return 500, {"error": {"message": str(e)}}

    @staticmethod
    def _ok(result: dict) -> tuple[int, dict]:
        body = {"success": bool(result["success"]), "message": result.get("message", "")}
        return (200 if result["success"] else 400), body

    # -- serving ---------------------------------------------------------------------------------
    def _wait_unpaused(self, timeout: float | None) -> bool:
        with self.pause_cond:
            return self.pause_cond.wait_for(lambda: not self.paused, timeout=timeout)

    def generate(self, body: dict) -> tuple[int, Any]:
        typed = prompt_logprobs.field_refusal(body)  # FastAPI's 422, then the JSON contract's 400
        if typed is not None:
            return typed
        if body.get("text") is not None or body.get("input_ids") is None:
            return 400, {"error": {"message": "the CPU server takes input_ids only (text needs a tokenizer)"}}
        ids = body["input_ids"]
        single = len(ids) > 0 and not isinstance(ids[0], list)
        batch = [ids] if single else list(ids)
        if any(len(x) == 0 for x in batch):
            return 400, {"error": {"message": "input_ids is empty"}}
        sps = body.get("sampling_params") or {}
        sps = list(sps) if isinstance(sps, list) else [sps] * len(batch)
        if len(sps) != len(batch):
            return 400, {"error": {"message": f"{len(sps)} sampling_params for {len(batch)} inputs"}}
        try:  # return_logprob / logprob_start_len / top_logprobs_num per input
            asks = prompt_logprobs.per_request(body, len(batch))
        except IndexError:  # sglang's GenerateReqInput.__getitem__ on a short list: FastAPI's 500
            return 500, "Internal Server Error"
        decode = prompt_logprobs.text_decoder(self.args.model_path, bool(body.get("return_text_in_logprobs")))
        from gspo_megatron.cpu_server.lora import lora_paths_of

        try:
            lora_paths = lora_paths_of(body, len(batch))
        except ValueError as e:
            return 400, {"error": {"message": str(e)}}
        refusal = self.loras.resolve(lora_paths)
        if refusal is not None:
            return 400, {"error": {"message": refusal}}
        rre = body.get("return_routed_experts", False)
        rres = list(rre) if isinstance(rre, list) else [rre] * len(batch)
        rstart = body.get("routed_experts_start_len", 0)
        rstarts = list(rstart) if isinstance(rstart, list) else [rstart] * len(batch)
        rit = body.get(INDEXER_REQUEST_FLAG, False)
        rits = list(rit) if isinstance(rit, list) else [rit] * len(batch)
        self._wait_unpaused(None)  # TokenizerManager.generate_request: is_pause_cond
        t0 = time.time()
        status, results = self.run_requests(
            [
                {
                    "input_ids": x,
                    "sampling_params": sp or {},
                    "return_routed_experts": bool(re_),
                    "routed_experts_start_len": int(rs or 0),
                    INDEXER_REQUEST_FLAG: bool(ri),
                    "lora_path": lp_,
                    **ask,
                }
                for x, sp, re_, rs, ri, lp_, ask in zip(batch, sps, rres, rstarts, rits, lora_paths, asks)
            ]
        )
        if status != 200:
            return status, results
        rid = body.get("rid")
        outs = []
        for i, (x, r) in enumerate(zip(batch, results)):
            rid_i = rid if isinstance(rid, str) and single else uuid.uuid4().hex
            ask = asks[i]
            meta = self.meta_info(r, len(x), ask["return_logprob"], rid_i, t0, ask["top_logprobs_num"], decode)
            if r.get("routed_experts") is not None:  # sglang: base64 of the int32 bytes
                meta["routed_experts"] = encode_routed_experts(r["routed_experts"])
            if r.get(INDEXER_META_KEY) is not None:  # the same encoding (sglang's detokenizer)
                meta[INDEXER_META_KEY] = encode_routed_experts(r[INDEXER_META_KEY])
            if not r.get("waiting_abort"):
                # speculative decoding: sglang's _calculate_spec_decoding_metrics (cpu_server/speculative.py)
                meta.update(
                    spec_meta_info(r.get("spec"), len(r["output_ids"]), self.args.speculative_num_draft_tokens or 1)
                )
            outs.append({"text": "", "output_ids": list(r["output_ids"]), "meta_info": meta})
        return 200, (outs[0] if single else outs)

    def health(self, body: dict) -> tuple[int, Any]:
        # sglang 0.5.23 serves /health with the /health_generate function; it answers without
        # generating only when SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is off (default on, srt/environ.py)
        if os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true").lower() in ("0", "false", "no", "off"):
            return 200, ""
        return self.health_generate(body)

    def health_generate(self, body: dict) -> tuple[int, Any]:
        """sglang: a one-token generation through the normal path (pause wait, reader lock), healthy
        when an answer comes within HEALTH_CHECK_TIMEOUT; while requests run, their progress counts."""
        if not self._wait_unpaused(HEALTH_CHECK_TIMEOUT):
            return 503, ""
        with self.work:
            busy = self.live > 0 and not self.engine_paused
        if busy:
            return 200, ""
        status, _ = self.run_requests(
            [{"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}],
            read_timeout=HEALTH_CHECK_TIMEOUT,
        )
        # a failing generation, or memory released: sglang runs its one-token request on the
        # unmapped KV pool / weights, the scheduler dies, no answer within the timeout: 503
        return (200, "") if status == 200 else (503, "")

    def server_info(self, body: dict) -> tuple[int, Any]:
        info = dict(vars(self.args))
        info.update(
            startup_time=self.startup_time,
            internal_states=[{"weight_version": self.weight_version}],
            version=SGLANG_VERSION_TESTED,
            frontend="python",
        )
        return 200, info

    def model_info(self, body: dict) -> tuple[int, Any]:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(self.args.model_path)
        return 200, {
            "model_path": self.args.model_path,
            "served_model_name": self.args.model_path,
            "tokenizer_path": self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "load_format": self.args.load_format,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }

    def flush_cache(self, body: dict) -> tuple[int, Any]:
        result = self.command("flush_cache")
        if result["success"]:
            return 200, (
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                "waiting requests, the operation will not be performed.)\n"
            )
        return 400, result.get("message") or "Flush cache failed.\n"

    # -- weights ---------------------------------------------------------------------------------
    def _version(self, result: dict, body: dict) -> tuple[int, dict]:
        status, out = self._ok(result)
        if result["success"] and body.get("weight_version") is not None:
            out["message"] += f" Weight version updated to {body['weight_version']}."
        return status, out

    def weight_call(self, op: str, kw: dict, body: dict) -> tuple[int, dict]:
        return self._ok(self.command(op, **kw))

    def begin_weight_update(self, body: dict) -> tuple[int, dict]:
        """``selector`` (sglang 0.5.23 ``BeginWeightUpdateReqInput``): the runners the session opens
        (``cpu_server/speculative.py``); a value outside the Literal is FastAPI's 422."""
        refusal = selector_refusal(body)
        if refusal is not None:
            return refusal
        return self.locked_update(lambda: self._ok(self.command("begin", selector=body.get("selector", "all"))))

    def init_group(self, body: dict) -> tuple[int, dict]:
        kw = _fields(body, "master_address", "master_port", "rank_offset", "world_size", "group_name")
        kw["backend"] = body.get("backend") or "nccl"
        return self._ok(self.command("init_group", **kw))

    def destroy_group(self, body: dict) -> tuple[int, dict]:
        return self._ok(self.command("destroy_group", group_name=body.get("group_name", "weight_update_group")))

    def update_distributed(self, body: dict) -> tuple[int, dict]:
        kw = _fields(body, "names", "dtypes", "shapes", "group_name")
        refusal = selector_refusal(body)
        if refusal is not None:
            return refusal
        kw["load_format"] = body.get("load_format")
        kw["selector"] = body.get("selector", "all")
        kw.update(weight_version=body.get("weight_version"), flush_cache=body.get("flush_cache", True))
        return self.locked_update(
            lambda: self._version(
                self.command("update_distributed", _new_version=body.get("weight_version"), **kw), body
            ),
            body,
        )

    def update_tensor(self, body: dict) -> tuple[int, dict]:
        kw = _fields(body, "serialized_named_tensors")
        refusal = selector_refusal(body)
        if refusal is not None:
            return refusal
        payloads = kw["serialized_named_tensors"]
        if isinstance(payloads, (str, bytes)):
            payloads = [payloads]
        return self.locked_update(
            lambda: self._version(
                self.command(
                    "update_tensor",
                    _new_version=body.get("weight_version"),
                    serialized_named_tensors=list(payloads),
                    load_format=body.get("load_format"),
                    selector=body.get("selector", "all"),
                    weight_version=body.get("weight_version"),
                    flush_cache=body.get("flush_cache", True),
                ),
                body,
            ),
            body,
        )

    def update_weight_version(self, body: dict) -> tuple[int, dict]:
        kw = _fields(body, "new_version")
        if body.get("abort_all_requests", True):  # sglang's default: abort every request first
            self.command("abort_all")
        self.command("record_version", new_version=str(kw["new_version"]))  # handle_update_weight_version
        self.weight_version = str(kw["new_version"])
        return 200, {
            "success": True,
            "message": f"Weight version updated to {self.weight_version}",
            "new_version": self.weight_version,
        }

    def get_weights_by_name(self, body: dict) -> tuple[int, Any]:
        kw = _fields(body, "name")
        result = self.command("get_weights_by_name", name=kw["name"], truncate_size=body.get("truncate_size", 100))
        return 400, {"error": {"message": result["message"]}}

    def memory(self, op: str, body: dict) -> tuple[int, Any]:
        result = self.command(op, tags=body.get("tags"))
        if not result["success"]:
            return 400, {"error": {"message": result["message"]}}
        return 200, None

    # -- LoRA adapters (cpu_server/lora.py) --------------------------------------------------------
    def load_lora_from_tensors(self, body: dict) -> tuple[int, Any]:
        _fields(body, "lora_name", "config_dict", "serialized_named_tensors")
        return self.loras.load(body, self.command)

    def load_lora_from_path(self, body: dict) -> tuple[int, Any]:
        _fields(body, "lora_name", "lora_path")
        return self.loras.load_path(body, self.command)

    def unload_lora(self, body: dict) -> tuple[int, Any]:
        _fields(body, "lora_name")
        return self.loras.unload(body, self.command)

    # -- test-only -------------------------------------------------------------------------------
    def weight_shards(self, body: dict) -> tuple[int, Any]:
        kw = _fields(body, "names")
        result = self.command("shards", names=list(kw["names"]))  # encoded by each rank (encode_tensor)
        return 200, {"ranks": [r["shards"] for r in result["ranks"]]}

    def memory_report(self, body: dict) -> tuple[int, Any]:
        result = self.command("memory")
        return 200, {"ranks": [{k: v for k, v in r.items() if k != "success"} for r in result["ranks"]]}


class _Missing(KeyError):
    pass


def _fields(body: dict, *names: str) -> dict:
    for n in names:
        if n not in body:
            raise _Missing(n)
    return {n: body[n] for n in names}


def encode_tensor(t: torch.Tensor) -> dict:
    t = t.detach().contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": base64.b64encode(raw).decode()}


def decode_tensor(d: dict) -> torch.Tensor:
    dtype = torch_dtype(d["dtype"])
    raw = bytearray(base64.b64decode(d["data"]))
    if not raw:
        return torch.empty(d["shape"], dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(d["shape"]).clone()


class FrontServer(ThreadingHTTPServer):
    """The server :func:`make_server` builds: requests go to ``front_holder[0]`` (503 while None)."""

    request_queue_size = 2048  # uvicorn's backlog (sglang); the default 5 resets concurrent clients
    front_holder: list[Front | None]


def make_server(front: Front | None, host: str, port: int) -> FrontServer:
    """A threaded HTTP server dispatching to ``server.front_holder[0]`` (503 while it is None)."""
    holder: list[Front | None] = [front]

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *a: Any) -> None:  # quiet access log
            pass

        def _serve(self, method: str) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            try:
                body = json.loads(raw) if raw.strip() else None
            except json.JSONDecodeError as e:
                self._send(422, {"detail": [{"type": "json_invalid", "msg": str(e)}]})
                return
            if body is not None and not isinstance(body, dict):
                self._send(422, {"detail": [{"type": "model_attributes_type", "msg": "body must be an object"}]})
                return
            if holder[0] is None:
                self._send(503, "")
                return
            status, payload = holder[0].call(method, urlparse(self.path).path, body)
            self._send(status, payload)

        def _send(self, status: int, payload: Any) -> None:
            if isinstance(payload, str):
                data, ctype = payload.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(payload).encode(), "application/json"
            self.send_response(status, HTTPStatus(status).phrase)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting
                pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

    server = FrontServer((host, port), Handler)
    server.daemon_threads = True
    server.front_holder = holder
    return server
