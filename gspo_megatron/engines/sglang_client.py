"""The thin client of one SGLang HTTP server (``sglang.launch_server``, or the CPU stand-in
``cpu_server`` that speaks the same API), and the one pause / flush / session sequence that
brackets every weight update.

Written against sglang 0.5.23's routes (``srt/entrypoints/http_server.py``) and request fields
(``srt/managers/io_struct.py``). Weight-update calls return SGLang's ``{success, message}``; a
failure raises :class:`SGLangError` naming the engine and the call. Called on the trainer ranks that
talk to an engine (rank 0 for generation; colocated and disaggregated sync sources). No sglang import.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Sequence


class SGLangError(RuntimeError):
    """An SGLang call failed; the message names the engine and the call."""


def _check(result: Any, where: str) -> Any:
    """SGLang weight calls return (success, message) or an object/dict with .success."""
    if isinstance(result, tuple) and len(result) >= 2 and isinstance(result[0], bool):
        ok, msg = result[0], result[1]
    elif isinstance(result, dict) and "success" in result:
        ok, msg = result["success"], result.get("message", "")
    elif hasattr(result, "success"):
        ok, msg = result.success, getattr(result, "message", "")
    else:
        return result
    if not ok:
        raise SGLangError(f"{where} failed: {msg}")
    return result


PAUSE_MODES = ("abort", "retract", "in_place")  # sglang 0.5.23 PauseGenerationReqInput.mode


def _error_body(e: urllib.error.HTTPError) -> str:
    """The error answer's body (first 2000 chars). A server that exits right after answering
    (sglang's scheduler dying on a failed update takes its HTTP server with it) can cut the
    body short: what arrived is kept, the status line is the error either way."""
    try:
        return e.read().decode(errors="replace")[:2000]
    except http.client.IncompleteRead as cut:
        return cut.partial.decode(errors="replace")[:2000] + " [body cut short: the server closed]"
    except (OSError, http.client.HTTPException):
        return "[no body: the server closed]"


class SGLangHttpClient:
    """One SGLang HTTP server (``python -m sglang.launch_server``) at ``base_url``.

    pause_mode: how a weight sync pauses it (sglang 0.5.23's ``/pause_generation`` ``mode``, see
    :func:`open_weight_update`): ``"abort"`` (sglang's default; the synchronous and overlapped loops
    sync with nothing running), or ``rollout.inflight_updates``' ``"in_place"`` / ``"retract"`` /
    ``"abort"`` (``orchestration/inflight.py``)."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout_s: float = 3600.0, pause_mode: str = "abort"
    ):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"SGLangHttpClient: pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        self._has_sessions: bool | None = None  # begin/end_weight_update routes (newer SGLang)
        self._tp_size: int | None = None

    def __repr__(self) -> str:
        return f"SGLangHttpClient({self.base_url!r})"

    # -- transport -------------------------------------------------------------------------------
    def request(self, method: str, route: str, payload: Any = None, timeout_s: float | None = None):
        """One HTTP call; returns the decoded JSON (or text); raises SGLangError on HTTP errors."""
        url = f"{self.base_url}/{route.lstrip('/')}"
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            raise SGLangError(f"{method} {url} -> HTTP {e.code}: {_error_body(e)}") from e
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise SGLangError(f"{method} {url} unreachable: {e}") from e
        if not body:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return body.decode(errors="replace")

    def post(self, route: str, payload: Any = None, **kw):
        return self.request("POST", route, {} if payload is None else payload, **kw)

    # -- serving ---------------------------------------------------------------------------------
    def health(self, timeout_s: float = 10.0) -> bool:
        """True when ``/health_generate`` answers 200 (runs a one-token generation)."""
        try:
            self.request("GET", "health_generate", timeout_s=timeout_s)
            return True
        except SGLangError:
            return False

    def alive(self, timeout_s: float = 10.0) -> bool:
        """True when ``/server_info`` answers: a round trip to the scheduler (its internal state)
        that generates nothing, for an engine whose memory is released. sglang 0.5.23's
        ``/health_generate`` and ``/health`` (``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` defaults
        on) both run a one-token request, which on a released KV cache is an illegal memory access."""
        try:
            self.request("GET", "server_info", timeout_s=timeout_s)
            return True
        except SGLangError:
            return False

    def server_info(self) -> dict:
        """``/server_info`` (sglang 0.5.23; ``/get_server_info`` is its deprecated alias, kept for
        older servers)."""
        try:
            return self.request("GET", "server_info")
        except SGLangError as e:
            if "HTTP 404" not in str(e):
                raise
            return self.request("GET", "get_server_info")

    @property
    def tp_size(self) -> int:
        """The engine's tensor-parallel size: CUDA IPC sends one payload per TP rank."""
        if self._tp_size is None:
            self._tp_size = int(self.server_info().get("tp_size", 1))
        return self._tp_size

    @property
    def world_size(self) -> int:
        """GPUs (processes) of this engine as it reports them: tp_size * pp_size. The weight-update
        group's size is built from this, never from the trainer's config: a mismatch hangs
        ``init_weights_update_group``."""
        info = self.server_info()
        return int(info.get("tp_size", 1)) * int(info.get("pp_size", 1) or 1)

    def weight_version(self) -> str | None:
        """The version string of the weights the engine serves (``/model_info``'s weight_version,
        set by the ``weight_version`` field of each update)."""
        try:
            info = self.request("GET", "model_info")
        except SGLangError as e:
            if "HTTP 404" not in str(e):
                raise
            info = self.request("GET", "get_model_info")
        return info.get("weight_version") if isinstance(info, dict) else None

    def generate(
        self,
        input_ids: Sequence[Sequence[int]],
        sampling_params: Sequence[dict],
        return_logprob: bool = True,
        batch: bool = True,
        return_routed_experts: bool = False,
        return_indexer_topk: bool = False,
        lora_path: str | None = None,
    ) -> list[dict]:
        """``/generate`` from token ids; one output dict per input, in order. ``batch``: one request
        with lists of ``input_ids`` and ``sampling_params`` (the SGLang server's batch form);
        otherwise one request per input with a single ``input_ids`` list and ``sampling_params``
        object (the form the SGLang router's ``/generate`` accepts: its request type takes one
        sampling-params object). ``return_routed_experts``: ask for ``meta_info["routed_experts"]``
        over the whole sequence (``routed_experts_start_len`` 0; ``engines/routing.py``);
        ``return_indexer_topk`` (DSA models): ``meta_info["indexer_topk"]``, always ``[0, seqlen - 1)``;
        ``lora_path``: the loaded LoRA adapter to serve with (None: the base)."""
        extra: dict[str, Any] = (
            {"return_routed_experts": True, "routed_experts_start_len": 0} if return_routed_experts else {}
        )
        if return_indexer_topk:
            extra["return_indexer_topk"] = True
        if lora_path is not None:  # sglang's GenerateReqInput.lora_path: the adapter name (one for the batch)
            extra["lora_path"] = lora_path
        if batch:
            out = self.post(
                "generate",
                {
                    "input_ids": [list(map(int, ids)) for ids in input_ids],
                    "sampling_params": list(sampling_params),
                    "return_logprob": return_logprob,
                    **extra,
                },
            )
            return out if isinstance(out, list) else [out]
        outs = []
        for ids, sp in zip(input_ids, sampling_params):
            out = self.post(
                "generate",
                {
                    "input_ids": list(map(int, ids)),
                    "sampling_params": dict(sp),
                    "return_logprob": return_logprob,
                    **extra,
                },
            )
            outs.append(out[0] if isinstance(out, list) else out)
        return outs

    def pause_generation(self, mode: str | None = None) -> None:
        """``/pause_generation`` (sglang 0.5.23 ``PauseGenerationReqInput``): ``mode`` None sends no
        body (sglang's default, ``"abort"``)."""
        self.post("pause_generation", None if mode is None else {"mode": mode})

    def continue_generation(self) -> None:
        self.post("continue_generation")

    def flush_cache(self) -> None:
        self.post("flush_cache")

    # -- weight sync -----------------------------------------------------------------------------
    def begin_weight_update(self, selector: str | None = None) -> bool:
        """Open SGLang's weight-update session (required by newer versions before any
        update_weights_from_*); False when this server predates sessions (route missing).
        ``selector``: sglang 0.5.23's ``target`` | ``draft`` | ``all`` (the runners of a speculative engine
        the session opens; None: the server's default, ``all``)."""
        if self._has_sessions is False:
            return False
        body = {} if selector is None else {"selector": selector}
        try:
            _check(self.post("begin_weight_update", body), f"{self}.begin_weight_update")
        except SGLangError as e:
            if "HTTP 404" in str(e) or "HTTP 405" in str(e):
                self._has_sessions = False
                return False
            raise
        self._has_sessions = True
        return True

    def end_weight_update(self) -> None:
        if self._has_sessions:
            _check(self.post("end_weight_update", {}), f"{self}.end_weight_update")

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
        selector: str | None = None,
    ) -> None:
        """``serialized_named_tensors``: one base64 payload per engine TP rank (rank i reads item i).
        ``selector``: the runners that load it (sglang 0.5.23: ``target`` | ``draft`` | ``all``; None: ``all``)."""
        payload = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if selector is not None:
            payload["selector"] = selector
        _check(self.post("update_weights_from_tensor", payload), f"{self}.update_weights_from_tensor")

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> None:
        payload = dict(
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
        )
        _check(self.post("init_weights_update_group", payload), f"{self}.init_weights_update_group")

    def destroy_weights_update_group(self, group_name: str) -> None:
        _check(
            self.post("destroy_weights_update_group", {"group_name": group_name}),
            f"{self}.destroy_weights_update_group",
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        flush_cache: bool = False,
        weight_version: str | None = None,
        load_format: str | None = None,
        selector: str | None = None,
    ) -> None:
        """``selector``: the runners that load what the target receives (sglang 0.5.23: ``target`` |
        ``draft`` | ``all``; None: ``all``)."""
        payload: dict[str, Any] = dict(
            names=list(names),
            dtypes=list(dtypes),
            shapes=[list(s) for s in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
        )
        if weight_version is not None:
            payload["weight_version"] = weight_version
        if load_format is not None:
            payload["load_format"] = load_format
        if selector is not None:
            payload["selector"] = selector
        _check(self.post("update_weights_from_distributed", payload), f"{self}.update_weights_from_distributed")

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang returns the leading ``truncate_size`` rows of TP rank 0's shard (as nested lists)."""
        out = self.post("get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        if out is None or (isinstance(out, dict) and "error" in out):
            raise SGLangError(f"{self}.get_weights_by_name({name!r}) failed: {out}")
        return out

    # -- colocation ------------------------------------------------------------------------------
    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self.post("release_memory_occupation", {"tags": None if tags is None else list(tags)})

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        self.post("resume_memory_occupation", {"tags": None if tags is None else list(tags)})

    def shutdown(self) -> None:
        """Nothing to close for HTTP (the launcher owns the server process)."""


def open_weight_update(client) -> None:
    """Before the first bucket of a sync: pause generation in the client's ``pause_mode``, flush the
    KV / radix cache (entries of the old weights) and open SGLang's weight-update session (0.5.23
    refuses updates outside one). ``in_place``: no flush: sglang refuses ``/flush_cache`` while
    requests run, and in place they keep running (``scheduler.py`` ``flush_cache``: not
    ``is_fully_idle``); its engines run without a radix cache instead (``features/inflight.py``)."""
    mode = getattr(client, "pause_mode", "abort")
    if mode == "abort":
        client.pause_generation()  # no body: sglang's default mode
    else:
        client.pause_generation(mode)
    if mode != "in_place":
        client.flush_cache()
    client.begin_weight_update()


def close_weight_update(client) -> None:
    """After the last bucket: close the session, flush again (not ``in_place``: above), continue
    generation (retracted requests are prefilled again under the new weights, in-place ones decode on)."""
    client.end_weight_update()
    if getattr(client, "pause_mode", "abort") != "in_place":
        client.flush_cache()
    client.continue_generation()
