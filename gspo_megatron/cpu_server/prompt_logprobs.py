"""Prompt ("input") log-probs and top log-probs of ``/generate``, as sglang 0.5.23 computes and answers
them (the teacher-scoring use: ``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len``).

What sglang does, file by file (``srt/``), and where this server does the same:

- ``managers/scheduler.py`` ``_handle_generate_request``: ``return_logprob`` false: ``logprob_start_len``
  is ignored (and ``top_logprobs_num``: nothing is answered). ``-1`` (default) becomes the input length
  (no input log-probs). A start over the input length aborts the request with 400 and "{req.logprob_start_len=}
  is higher than the number of input tokens {len(req.origin_input_ids)=}. Please use a smaller
  logprob_start_len." (:func:`resolve`).
- ``managers/schedule_batch.py`` ``prepare_for_extend`` + ``layers/logits_processor.py`` +
  ``layers/logprob_processor.py`` ``InputLogprobProcessor``: positions ``L .. n-1`` each give
  ``log_softmax(logits)`` (no temperature) gathered at the NEXT input token (the last one at a padded 0);
  ``managers/scheduler_components/logprob_result_processor.py`` ``_process_input_token_logprobs`` then
  answers ``[None] + those[:-1]`` with ids ``origin_input_ids[L:]`` (ids >= vocab_size - 1 written as
  0: its "clip padded hash values" line). So entry j is the log-prob of input token ``L + j`` for
  j >= 1 and entry 0 is ``None`` for EVERY start, not only 0 (:func:`input_logprobs`). ``L == n``: ``[]``.
  Top-k rows (``_process_input_top_logprobs``): ``[None]`` + one row per position, the last popped;
  ``torch.topk`` of the same log-softmax, largest first.
- A negative start other than -1: nothing refuses it; ``compute_extend_logprob_start_len`` computes from
  position 0 and ``_process_input_token_logprobs`` takes ids ``origin_input_ids[L:]``, so with ``-L >= n``
  it answers as start 0, else ``add_input_logprob_return_values``' length assert fails and the scheduler
  dies (the server ends; :attr:`LogprobAsk.death`, raised as ``SchedulerDeath`` at the prefill).
- ``top_logprobs_num`` over the vocabulary: ``topk`` raises in the scheduler, which dies (:func:`topk`);
  zero or negative: no top log-probs and no ``*_top_logprobs`` keys.
- ``max_new_tokens`` 0 (``Req.is_prefill_only``, not with speculative decoding): ``tp_worker.py`` samples
  nothing (dummy token 0), ``finish_reason`` ``{"type": "length", "length": 0}``, no output token, no
  output log-prob; with ``top_logprobs_num`` the sampler's ``compute_logprobs_only`` still gives one
  ``output_top_logprobs`` row: top-k of ``log_softmax`` of the last position's logits (no temperature).
  In a batch that is not all prefill-only (or on a speculative server) the request's token is sampled
  as any other and its log-prob answered (``output_streamer.py``: ``max(len(output_ids), 1)`` entries)
  while ``output_ids`` stays empty (``finished_len`` 0).
- ``managers/tokenizer_manager.py`` ``add_logprob_to_meta_info`` / ``detokenize_logprob_tokens`` /
  ``detokenize_top_logprobs_tokens``: ``input_token_logprobs``, ``output_token_logprobs``,
  ``output_token_logprobs_length`` and, with ``top_logprobs_num`` > 0, ``input_top_logprobs`` and
  ``output_top_logprobs``; each entry ``(logprob, token_id, text)`` with the text only under
  ``return_text_in_logprobs`` (this server decodes with the model directory's tokenizer when it has one,
  else ``None``, as sglang with ``--skip-tokenizer-init``); a top row that is empty or ``None`` is ``None``.
- Field types: FastAPI's validation of ``GenerateReqInput`` (pydantic, 422) and then the JSON contract
  (``entrypoints/api_contract.py``: ``sglang.api.v1.api_types`` ``decode_Int64OrList`` /
  ``decode_BoolOrList`` / ``_expect_bool``, 400 ``{"error": "<text>"}``) (:func:`field_refusal`).
  ``GenerateReqInput._normalize_logprob_params``: a scalar applies to every input, a list is per input
  (too short: ``obj[i]`` raises IndexError, FastAPI's 500) (:func:`per_request`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from gspo_megatron.cpu_server.sglang_runtime import SchedulerDeath

# GenerateReqInput's annotations (managers/io_struct.py), in its field order: what FastAPI validates
_FIELD_TYPES: dict[str, Any] = {
    "return_logprob": Optional[Union[List[bool], bool]],
    "logprob_start_len": Optional[Union[List[int], int]],
    "top_logprobs_num": Optional[Union[List[int], int]],
    "return_text_in_logprobs": bool,
}
# the JSON contract's decoder of each field (sglang/api/v1/api_types.py decode_GenerateRequest)
_CONTRACT = {
    "return_logprob": ("BoolOrList", "a boolean"),
    "logprob_start_len": ("Int64OrList", "i64"),
    "top_logprobs_num": ("Int64OrList", "i64"),
    "return_text_in_logprobs": (None, "a boolean"),
}


# -- the front: field checks and per-request values -----------------------------------------------
def field_refusal(body: dict) -> tuple[int, Any] | None:
    """sglang's refusal of the log-prob fields' types (module docstring), or None."""
    errors = _pydantic_errors(body)
    if errors:
        return 422, {"detail": errors}
    for key, value in body.items():  # api_contract.generate_contract_error: the body's key order
        if key in _CONTRACT and value is not None:
            msg = _contract_error(value, *_CONTRACT[key])
            if msg is not None:
                return 400, {"error": msg}
    if body.get("token_ids_logprob"):  # stand-in limit, not sglang's
        return 400, {"error": {"message": "token_ids_logprob: not served by the CPU server"}}
    return None


def _pydantic_errors(body: dict) -> list[dict]:
    try:
        from pydantic import TypeAdapter, ValidationError
    except ImportError:  # without pydantic (no sglang-cpu extra) the contract check below refuses alone
        return []
    errors: list[dict] = []
    for field, typ in _FIELD_TYPES.items():
        if field not in body:
            continue
        try:
            _adapter(TypeAdapter, typ).validate_python(body[field])
        except ValidationError as e:  # FastAPI: errors(include_url=False), loc ("body", field, ...)
            errors += [{**err, "loc": ["body", field, *err["loc"]]} for err in e.errors(include_url=False)]
    return errors


@functools.lru_cache(maxsize=None)
def _adapter(adapter_cls: Any, typ: Any) -> Any:
    return adapter_cls(typ)


def _unexpected(v: Any) -> str:
    """api_types.py ``_unexpected`` (serde's ``Unexpected`` display)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _contract_error(value: Any, alias: str | None, element: str) -> str | None:
    """api_types.py ``decode_<alias>`` (a scalar or a list of ``element``), or ``_expect_bool`` (alias None)."""
    is_bool = element == "a boolean"

    def ok(v: Any) -> bool:
        return isinstance(v, bool) if is_bool else isinstance(v, int) and not isinstance(v, bool)

    if alias is not None and isinstance(value, list):
        for e in value:
            if not ok(e):
                return f"invalid type: {_unexpected(e)}, expected {element}"
        return None
    if ok(value):
        return None
    expected = element if alias is None else f"a value or an array of values for {alias}"
    return f"invalid type: {_unexpected(value)}, expected {expected}"


def per_request(body: dict, n: int) -> list[dict]:
    """``GenerateReqInput._normalize_logprob_params``: each input's ``return_logprob``,
    ``logprob_start_len``, ``top_logprobs_num``. IndexError for a list shorter than the batch (sglang's
    ``obj[i]``: a 500). A single input given a list takes its first element (sglang passes the list on)."""

    def values(name: str, default: Any) -> list:
        v = body.get(name)
        if v is None:
            return [default] * n
        if not isinstance(v, list):
            return [v] * n
        return [v[i] for i in range(n)]

    return [
        {"return_logprob": bool(lp), "logprob_start_len": int(start), "top_logprobs_num": int(k)}
        for lp, start, k in zip(
            values("return_logprob", False), values("logprob_start_len", -1), values("top_logprobs_num", 0)
        )
    ]


@functools.lru_cache(maxsize=4)
def _tokenizer(model_path: str) -> Any:
    # only a directory with tokenizer files (transformers 5 builds an empty tokenizer from none)
    if not any(os.path.exists(os.path.join(model_path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    except Exception:  # noqa: BLE001 - no tokenizer in the directory: texts are None
        return None


def text_decoder(model_path: str, return_text: bool) -> Callable[[Sequence[int]], list]:
    """``ids -> texts`` of the answer's log-prob entries: sglang's ``batch_decode([[id] ...])`` with the
    directory's tokenizer under ``return_text_in_logprobs``; ``None`` each otherwise or without one."""
    tok = _tokenizer(model_path) if return_text else None
    if tok is None:
        return lambda ids: [None] * len(ids)
    return lambda ids: list(tok.batch_decode([[int(i)] for i in ids]))


def add_logprob_meta(meta: dict, out: dict, top_logprobs_num: int, decode: Callable[[Sequence[int]], list]) -> None:
    """``TokenizerManager.add_logprob_to_meta_info`` for one answer (``out``: the scheduler's result)."""

    def entries(vals: Sequence, ids: Sequence[int]) -> list:
        return [[v, int(i), t] for v, i, t in zip(vals, ids, decode(ids))]

    def top_entries(rows_v: Sequence, rows_i: Sequence) -> list:
        return [entries(v, i) if v else None for v, i in zip(rows_v, rows_i)]

    inp = out.get("input_logprobs") or {}
    meta["input_token_logprobs"] = entries(inp.get("val", []), inp.get("idx", []))
    ids = out.get("logprob_ids", out["output_ids"])
    meta["output_token_logprobs"] = entries([float(v) for v in out["logprobs"]], ids)
    meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    if top_logprobs_num > 0:
        meta["input_top_logprobs"] = top_entries(inp.get("top_val", []), inp.get("top_idx", []))
        top = out.get("top") or []
        meta["output_top_logprobs"] = top_entries([r[0] for r in top], [r[1] for r in top])


# -- the scheduler (TP rank 0) ----------------------------------------------------------------------
@dataclass(frozen=True)
class LogprobAsk:
    """A request's ``return_logprob`` as its scheduler holds it: ``start`` the position input log-probs
    start at (``n``: none), ``top`` its ``top_logprobs_num``, ``death`` what sglang's scheduler would
    die of at its prefill (None: nothing)."""

    start: int
    top: int
    death: str | None = None


def resolve(return_logprob: bool, start_len: int, top: int, n: int, speculative: bool) -> LogprobAsk | None:
    """``Scheduler._handle_generate_request``'s ``logprob_start_len`` rules (module docstring); None
    without ``return_logprob``. ValueError: the request's 400 (sglang's message)."""
    if not return_logprob:  # "When return_logprob is False, logprob_start_len should be ignored"
        return None
    start = n if start_len == -1 else start_len
    if start > n:
        raise ValueError(
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={n}. Please use a smaller logprob_start_len."
        )
    if speculative and top > 0:  # stand-in limit: the draft-verify loop keeps no full distributions
        raise ValueError("top_logprobs_num with speculative decoding: not served by the CPU server")
    death = None
    if start < 0:  # computed from position 0; answered ids origin_input_ids[start:]
        if -start < n:
            death = (
                f"AssertionError: logprob_result_processor.py add_input_logprob_return_values: {n} input "
                f"log-probs for logprob_start_len={start_len}, {-start} ids (len(origin_input_ids[{start_len}:]))"
            )
        start = 0
    return LogprobAsk(start, top, death)


def topk(logprobs: torch.Tensor, k: int) -> tuple[list, list]:
    """``logprobs.topk(k)`` rows (largest first) as lists; k over the vocabulary is the RuntimeError
    sglang's scheduler dies of (``layers/logprob_processor.py``)."""
    if k > logprobs.shape[-1]:
        raise SchedulerDeath(f"RuntimeError: selected index k out of range (top_logprobs_num={k})")
    values, indices = logprobs.topk(k, dim=-1)
    return values.tolist(), indices.tolist()


def input_logprobs(logits: torch.Tensor, input_ids: Sequence[int], ask: LogprobAsk) -> dict:
    """The input log-probs of one prefill: ``logits`` [m, V] are positions ``n - m .. n - 1`` (at least
    ``ask.start .. n - 1``). ``{"val", "idx"}`` and, with ``ask.top`` > 0, ``{"top_val", "top_idx"}``."""
    n, start = len(input_ids), ask.start
    m, vocab = n - start, logits.shape[-1]
    out: dict = {"val": [], "idx": []}
    if ask.top > 0:
        out.update(top_val=[], top_idx=[])
    if m == 0:  # _initialize_empty_logprob_containers
        return out
    logp = torch.log_softmax(logits[logits.shape[0] - m :].float(), dim=-1)
    nxt = torch.tensor([*input_ids[start + 1 :], 0], dtype=torch.long).clamp_(0, vocab - 1)
    vals = logp.gather(-1, nxt[:, None])[:, 0].tolist()
    out["val"] = [None, *vals[:-1]]
    out["idx"] = [int(x) if x < vocab - 1 else 0 for x in input_ids[start:]]
    if ask.top > 0:
        tv, ti = topk(logp, ask.top)
        out["top_val"], out["top_idx"] = [None, *tv[:-1]], [None, *ti[:-1]]
    return out


def last_position_top(logits: torch.Tensor, k: int, temperature: float, clamp: bool = True) -> tuple[list, list]:
    """One ``output_top_logprobs`` row: top-k of ``log_softmax(logits / T)`` (T 0: greedy,
    ``log_softmax(logits)``) clamped to the dtype's minimum (``Sampler.forward`` +
    ``OutputLogprobProcessor.compute_logprobs``); a prefill-only request's row (``compute_logprobs_only``):
    T 0 and no clamp."""
    x = logits.float().view(1, -1)
    logp = torch.log_softmax(x / temperature if temperature > 0 else x, dim=-1)
    if clamp:
        logp.clamp_(min=torch.finfo(logp.dtype).min)
    v, i = topk(logp, k)
    return v[0], i[0]
