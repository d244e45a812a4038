"""Routed experts from the rollout engine (MoE routing replay, R3): decode, validate, encode, align.

What sglang 0.5.23 returns (read from its source; the CPU server returns the same):

- server flag ``--enable-return-routed-experts`` (``ServerArgs.enable_return_routed_experts``): the
  model runner creates ``srt/state_capturer/routed_experts.RoutedExpertsCapturer``, whose ``capture``
  is called by every MoE ``TopK`` with that layer's top-k expert ids of every token of the forward
  (prefill chunk or decode step); a server without the flag returns no routes;
- request fields (``managers/io_struct.GenerateReqInput``): ``return_routed_experts: bool = False``
  and ``routed_experts_start_len: int = 0``, the absolute position the returned routes start at
  (must be in ``[0, prompt_tokens]``; 0 = the whole sequence);
- response: ``meta_info["routed_experts"]`` (``managers/tokenizer_manager.py``), a base64 string of
  the raw bytes of an int32 array (the detokenizer encodes ``tensor.numpy().tobytes()`` with
  ``pybase64.b64encode``; ``extract_routed_experts_from_meta_info`` decodes it with
  ``np.frombuffer(..., dtype=np.int32)``), flat, C order, logically ``[tokens, layers, topk]`` where
  ``layers = num_hidden_layers`` (every decoder layer, dense ones included, as the capturer's buffer
  is sized) and ``topk = num_experts_per_tok`` (fused shared experts are cut off);
- which tokens: positions ``[routed_experts_start_len, seqlen - 1)`` of ``prompt + output`` with
  ``seqlen = prompt_tokens + completion_tokens``: every token the engine ran a forward on (the prompt
  at prefill, each output token but the last at the decode step that fed it in). Row ``i`` is the
  route of the token at position ``routed_experts_start_len + i``; the last output token was never an
  input, so it has no route.

In the trainer a row's position ``t`` inputs token ``t``; so the engine's route of token ``t`` is
replayed at position ``t`` (not at the label position ``t - 1``), and the last position of each
sequence and every padding position carry no route (:data:`NO_ROUTE`): the trainer routes them
itself (``trainer/route_replay.py``), so padding is never replayed onto an expert.

DSA models (DeepSeek-V3.2, GLM-5): the indexer's top-k key selection, returned the same way
(sglang 0.5.23, read from its source, not run here: the capture is CUDA/NPU-only):

- server flag ``--enable-return-indexer-topk`` (``arg_groups/fields/exec_.py:161``
  ``enable_return_indexer_topk``); ``state_capturer/indexer_topk.py:91`` ``create_indexer_capturer``
  builds an ``IndexerTopkCapturer`` (a ``BaseTopkCapturer``, ``state_capturer/base.py:121``) with
  ``num_indexer_layers = num_hidden_layers`` for DSA architectures (``configs/model_config.py:548``
  ``get_num_indexer_layers``) and ``topk = index_topk``; it asserts ``attn_tp_size == 1``
  (``indexer_topk.py:33``: DP attention only). Every indexer forward ends in
  ``maybe_capture_indexer_topk(layer_id, topk_result)`` (``layers/attention/dsa/dsa_indexer.py:1933``..``2247``);
- request field ``return_indexer_topk: bool = False`` (``managers/io_struct.py:269``); there is no
  start field: ``batch_result_processor.py:181`` ``_maybe_collect_indexer_topk`` always reads
  ``[0, seqlen - 1)`` (``routed_experts_start_len`` does not apply);
- response ``meta_info["indexer_topk"]`` (``managers/tokenizer_manager.py:2610``), base64 of int32
  bytes as for the routes (``detokenizer_manager.py:467``; ``indexer_topk.py:80``
  ``extract_indexer_topk_from_meta_info``: "Caller reshapes to (seqlen-1, num_indexer_layers,
  index_topk)"), logically ``[seqlen - 1, num_hidden_layers, index_topk]``; row ``t``: the keys query
  ``t`` attended to, -1 where the row has fewer than ``index_topk`` keys (``dsa_topk_backend.py:272``
  ``_topk_unfused``; short rows ``[0, .., t, -1, ..]``), in no particular order (a set);
- the values are what ``topk_transform`` returns: with ``SGLANG_DSA_FUSE_TOPK=0`` (``environ.py``,
  default 1) the key positions in the request's sequence (``_topk_unfused`` subtracts the row start);
  with the default fused transform, KV-pool slots (page-table or ragged offsets, ``dsa_topk_backend.py``
  ``fast_topk_transform_fused``), which no client can map back. So an sglang engine serving R3 for a
  DSA model runs with ``SGLANG_DSA_FUSE_TOPK=0``; :func:`decode_indexer_topk` refuses ids outside
  ``[-1, t]`` (KV slots land there), naming that setting.

The CPU server returns the same field from its own transformers forward
(``cpu_server/routes.py``: ``IndexerRecorder``). In the trainer, query position ``t`` of a sequence
replays row ``t`` (``models/deepseek_v32/indexer.py``); the last token and padding carry
:data:`NO_ROUTE` rows and select their own keys.

Errors: :class:`RoutedExpertsError` (a ``ValueError``) names the engine URL, the request and what is
wrong; a payload that does not match the model is never silently reshaped.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np

from gspo_megatron.wire_format import NO_ROUTE

#: sglang's meta_info key and request fields
META_KEY = "routed_experts"
REQUEST_FLAG = "return_routed_experts"
REQUEST_START = "routed_experts_start_len"
SERVER_FLAG = "--enable-return-routed-experts"
#: DSA: sglang's meta_info key, request field and server flag of the indexer's top-k
INDEXER_META_KEY = "indexer_topk"
INDEXER_REQUEST_FLAG = "return_indexer_topk"
INDEXER_SERVER_FLAG = "--enable-return-indexer-topk"


@dataclass(frozen=True)
class RouteSpec:
    """What a model's routes must look like: decoder layers, experts per token, routed experts."""

    num_layers: int
    topk: int
    num_experts: int
    index_topk: int = 0  # DSA models: the indexer's keys per query (0: no indexer, nothing asked)
    # the decoder layers with a router (None: every layer); sglang's capture buffer leaves a dense
    # layer's rows at 0 (DeepSeek's first_k_dense_replace), so those rows are not validated
    moe_layers: tuple[int, ...] | None = None


def route_spec_of(hf_config: dict) -> RouteSpec:
    """The :class:`RouteSpec` of a model from its config.json (a dict): every decoder layer, its
    experts per token and routed experts (``models.dims.ModelDims``)."""
    from gspo_megatron.models.dims import ModelDims

    d = ModelDims.from_hf_config(hf_config)
    return RouteSpec(
        d.num_layers, d.topk, d.num_experts, int(getattr(d, "index_topk", 0) or 0), tuple(int(i) for i in d.moe_layers)
    )


class RoutedExpertsError(ValueError):
    """A routed-experts payload that does not fit the model or the request (names engine and request)."""


def route_tokens(prompt_len: int, response_len: int, start_len: int = 0) -> int:
    """The number of routed tokens sglang returns: ``prompt_len + response_len - 1 - start_len``
    (``[start_len, seqlen - 1)``), never below 0."""
    return max(0, prompt_len + response_len - 1 - start_len)


def encode_routed_experts(routes: Any) -> str:
    """sglang's encoding: base64 of the int32 bytes (C order) of ``routes`` [tokens, layers, topk]."""
    arr = np.ascontiguousarray(np.asarray(routes, dtype=np.int32))
    return base64.b64encode(arr.tobytes()).decode("utf-8")


def _payload_bytes(payload: Any, where: str, server_flag: str, request_flag: str) -> bytes:
    """The bytes of a base64 ``meta_info`` payload; RoutedExpertsError naming ``where`` when it is
    missing (and which server flag / request field asks for it), not a string, or not base64."""
    if payload is None:
        raise RoutedExpertsError(
            f"{where} is missing (was the server started with {server_flag} and "
            f"the request sent with {request_flag}=true?)"
        )
    if not isinstance(payload, str):
        raise RoutedExpertsError(f"{where} must be a base64 string, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as e:
        raise RoutedExpertsError(f"{where} is not valid base64 ({e})") from None


def decode_routed_experts(
    payload: Any,
    *,
    num_tokens: int,
    num_layers: int,
    topk: int,
    num_experts: int,
    engine: str = "?",
    request: str = "?",
    moe_layers: tuple[int, ...] | None = None,
) -> np.ndarray:
    """Decode and validate ``meta_info["routed_experts"]`` -> int32 array [num_tokens, num_layers, topk].

    num_tokens: the tokens the request should carry routes for (:func:`route_tokens`); num_layers:
    the model's decoder layers; topk: experts per token; num_experts: routed experts (ids must be in
    ``[0, num_experts)``). engine / request name the source in the error (engine URL, request id or
    prompt index). moe_layers: the layers with a router (None: all); a dense layer's rows (sglang
    leaves them 0) are returned as they are, unchecked. Raises :class:`RoutedExpertsError` on a missing
    or non-string payload, bad base64, a byte count that is not whole int32s, a size that is not
    ``num_tokens * num_layers * topk``, an expert id out of range, or a token whose top-k repeats an
    expert (MoE layers).
    """
    where = f"engine {engine}, request {request}: meta_info[{META_KEY!r}]"
    raw = _payload_bytes(payload, where, SERVER_FLAG, REQUEST_FLAG)
    if len(raw) % 4:
        raise RoutedExpertsError(f"{where} holds {len(raw)} bytes, not a whole number of int32 values")
    flat = np.frombuffer(raw, dtype=np.int32)
    per_token = num_layers * topk
    if flat.size != num_tokens * per_token:
        got = f"{flat.size / per_token:g} tokens" if per_token else f"{flat.size} values"
        raise RoutedExpertsError(
            f"{where} holds {flat.size} int32 values ({got}); expected {num_tokens} tokens x "
            f"{num_layers} layers x top-{topk} = {num_tokens * per_token} (routes cover "
            f"[{REQUEST_START}, seqlen - 1) of prompt + output)"
        )
    routes = flat.reshape(num_tokens, num_layers, topk).copy()
    layers = np.arange(num_layers) if moe_layers is None else np.asarray(sorted(moe_layers), dtype=np.int64)
    moe = routes[:, layers]
    if moe.size:
        lo, hi = int(moe.min()), int(moe.max())
        if lo < 0 or hi >= num_experts:
            bad = np.argwhere((moe < 0) | (moe >= num_experts))[0]
            raise RoutedExpertsError(
                f"{where}: expert id {int(moe[tuple(bad)])} at token {bad[0]}, layer {layers[bad[1]]} is outside "
                f"[0, {num_experts}) (ids seen: {lo}..{hi})"
            )
        if topk > 1:
            srt = np.sort(moe, axis=-1)
            dup = np.argwhere((srt[..., 1:] == srt[..., :-1]).any(-1))
            if dup.size:
                t, layer = dup[0][0], layers[dup[0][1]]
                raise RoutedExpertsError(
                    f"{where}: token {t}, layer {layer} repeats an expert in its top-{topk} {routes[t, layer].tolist()}"
                )
    return routes


def decode_indexer_topk(
    payload: Any, *, num_tokens: int, num_layers: int, index_topk: int, engine: str = "?", request: str = "?"
) -> np.ndarray:
    """Decode and validate ``meta_info["indexer_topk"]`` -> int32 [num_tokens, num_layers, index_topk].

    num_tokens: ``seqlen - 1`` (row ``t`` is query position ``t``). Raises :class:`RoutedExpertsError`
    naming engine and request on a missing / non-base64 payload, a size that is not
    ``num_tokens * num_layers * index_topk``, a key outside ``[-1, t]`` in row ``t`` (KV-pool slots of
    sglang's fused transform land there), a repeated key, or a row whose count of keys is not
    ``min(t + 1, index_topk)``.
    """
    where = f"engine {engine}, request {request}: meta_info[{INDEXER_META_KEY!r}]"
    raw = _payload_bytes(payload, where, INDEXER_SERVER_FLAG, INDEXER_REQUEST_FLAG)
    flat = np.frombuffer(raw[: len(raw) - len(raw) % 4], dtype=np.int32)
    want = num_tokens * num_layers * index_topk
    if len(raw) % 4 or flat.size != want:
        raise RoutedExpertsError(
            f"{where} holds {len(raw)} bytes; expected {num_tokens} tokens x {num_layers} "
            f"layers x index_topk {index_topk} int32 = {want * 4} bytes (rows [0, seqlen - 1))"
        )
    sel = flat.reshape(num_tokens, num_layers, index_topk).copy()
    if sel.size:
        pos = np.arange(num_tokens, dtype=np.int64)[:, None, None]
        bad = np.argwhere((sel < NO_ROUTE) | (sel > pos))
        if bad.size:
            t, layer, _ = bad[0]
            raise RoutedExpertsError(
                f"{where}: token {t}, layer {layer} selects keys {sel[t, layer].tolist()} outside "
                f"[-1, {t}] (sequence positions; sglang needs SGLANG_DSA_FUSE_TOPK=0, "
                "whose ids are positions, not KV-pool slots)"
            )
        count = (sel >= 0).sum(-1)
        need = np.minimum(np.arange(num_tokens) + 1, index_topk)[:, None]
        srt = np.sort(sel, axis=-1)
        dup = ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any(-1)
        wrong = np.argwhere((count != need) | dup)
        if wrong.size:
            t, layer = wrong[0]
            raise RoutedExpertsError(
                f"{where}: token {t}, layer {layer} selects {sel[t, layer].tolist()}; expected "
                f"{int(need[t, 0])} distinct keys of [0, {t}] and -1 for the rest"
            )
    return sel


def routes_on_row(routes: np.ndarray | None, length: int, num_layers: int, topk: int, start_len: int = 0) -> np.ndarray:
    """One sequence's routes laid on its token positions: int32 [length, num_layers, topk].

    routes: [length - 1 - start_len, L, K] from :func:`decode_routed_experts` (None: no routes);
    position ``t`` (the input token ``t``) gets ``routes[t - start_len]``; positions before
    ``start_len`` and the last one get :data:`NO_ROUTE`.
    """
    out = np.full((length, num_layers, topk), NO_ROUTE, dtype=np.int32)
    if routes is None:
        return out
    routes = np.asarray(routes, dtype=np.int32)
    n = route_tokens(length, 0, start_len)
    if routes.shape != (n, num_layers, topk):
        raise RoutedExpertsError(
            f"routed_experts: shape {tuple(routes.shape)} does not fit a sequence of "
            f"{length} tokens from position {start_len} ({n}, {num_layers}, {topk})"
        )
    out[start_len : start_len + n] = routes
    return out


def route_agreement(engine: np.ndarray, trainer: np.ndarray) -> tuple[int, int]:
    """(agreeing, compared) (token, layer) top-k sets between two route arrays [..., K]; positions
    where either side is :data:`NO_ROUTE` are not compared. Order within a top-k set does not matter."""
    e, t = np.sort(np.asarray(engine), axis=-1), np.sort(np.asarray(trainer), axis=-1)
    valid = (e >= 0).all(-1) & (t >= 0).all(-1)
    same = (e == t).all(-1) & valid
    return int(same.sum()), int(valid.sum())


def compose_routes(tokens: list[int], calls: list[tuple[list[int], list[int], Any]]) -> np.ndarray | None:
    """A multi-turn sequence's routes from the engine calls that produced it (custom rollouts).

    tokens: the final sequence, prompt + response (tool output and user turns included), n tokens.
    calls: per engine call in call order, (its prompt ids, its output ids, its routed experts int32
    [P_c + R_c - 1, L, K] or None). Returns int32 [n - 1, L, K]: position ``t`` gets the route of
    the latest call whose own sequence (prompt + output) agrees with ``tokens`` on positions 0..t
    (the same prefix: the engine ran its forward on that very token and context) and routed ``t``
    (``t < P_c + R_c - 1``). A tool output's tokens are routed by the next call's prefill, which
    reads them in its prompt. :data:`NO_ROUTE` where no call ran the token (tokens after the last
    call, or where a hook rewrote the context): the trainer routes those itself. None when no call
    carries routes (the engine was not asked for them).
    """
    with_routes = [c for c in calls if c[2] is not None]
    if not with_routes or len(tokens) < 2:
        return None if not with_routes else np.zeros((0,) + np.asarray(with_routes[0][2]).shape[1:], np.int32)
    L, K = np.asarray(with_routes[0][2]).shape[1:]
    out = np.full((len(tokens) - 1, L, K), NO_ROUTE, dtype=np.int32)
    for prompt, output, routes in with_routes:
        seq = list(prompt) + list(output)
        routes = np.asarray(routes, dtype=np.int32)
        if routes.shape != (len(seq) - 1, L, K):
            raise RoutedExpertsError(
                f"routed_experts of a generate call: shape {routes.shape} for {len(seq)} tokens; "
                f"expected {(len(seq) - 1, L, K)}"
            )
        same = 0
        while same < min(len(seq), len(tokens)) and seq[same] == tokens[same]:
            same += 1
        n = min(same, len(seq) - 1, len(tokens) - 1)
        out[:n] = routes[:n]
    return out
