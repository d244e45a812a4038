"""Custom rollouts (``rollout.custom_function: path/to/file.py:function``): multi-turn, tool calls.

Called on global rank 0 (from ``orchestration.batch.collect_rollouts``). The hook is called once per sample
(G times per prompt), each call in its own thread::

    def my_rollout(generate, sample) -> dict

- ``generate(prompt_ids, **overrides) -> RolloutSample``: the engine's token-in / token-out call (any
  engine: the in-process transformers engine, the engine subprocess, SGLang or its CPU stand-in).
  ``overrides`` are :class:`~gspo_megatron.engines.base.SamplingParams` fields (``max_new_tokens``,
  ``stop_token_ids``, ``temperature``, ...). The calls of all samples are gathered: when every
  running hook waits in ``generate``, their requests go to the engine together (one
  ``engine.generate`` per distinct set of sampling parameters, requests in sample order, so a run is
  deterministic for deterministic hooks and engines). A hook makes one call at a time (no threads of
  its own calling ``generate``); a hook that never returns blocks the step (there is no timeout).
- ``sample``: a :class:`HookSample` (prompt text and ids, label, tokenizer, default sampling
  parameters, the token budget).

The hook returns a dict:

- ``response_ids`` [R] list[int]: every token after the prompt (the policy's turns, tool output,
  user turns), ``prompt_len + R <= model.max_seq_len``;
- ``loss_mask`` [R] of 0/1: 1 on the tokens the policy sampled (trained), 0 on the rest;
- ``reward``: a number, or absent / None to score the decoded response with ``reward.function``;
- optional ``logprobs`` [R] (the engine's, checked), ``metrics`` {str: number} (averaged into
  ``custom/<key>``), ``truncated`` (bool; default: the last generate call hit max_new_tokens).

Token ids are never re-tokenized: the trained tokens, read in order, must be what the engine sampled
in this sample's generate calls, in call order (a call's output used whole or cut short, calls may
be left out). This is checked, and the engine log-probs of those tokens are taken from the calls
themselves. :class:`Trajectory` builds such a result. ``check_result`` converts it to the trainer's
record (``gspo_megatron.sample.Sample``). The loss then counts only the trained tokens:
the Sample's ``loss_mask`` becomes the micro-batch loss mask (``trainer.micro_batches.collate``), so the GSPO
length normalization |y_i|, old log-probs, the engine gap and TIS all cover exactly those tokens.
With ``rollout.routing_replay=r3`` each call's routed experts come back with it, and the Sample's
``routed_experts`` are composed from them (``engines.routing.compose_routes``): every token the
engine ran, prompt, policy turns and tool output (routed by the next call's prefill), carries the
route the engine used; tokens after the last call carry none (the trainer routes them itself).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from gspo_megatron.engines.base import RolloutSample, SamplingParams
from gspo_megatron.engines.routing import compose_routes
from gspo_megatron.errors import UserInputError
from gspo_megatron.sample import Sample

FIELD = "rollout.custom_function"


@dataclass
class HookSample:
    """What a rollout hook gets about its sample.

    prompt: the raw prompt text; prompt_ids: the formatted prompt's token ids (the sequence starts with
    them); label: the data row's label; index: this sample's number in its group (0..G-1);
    tokenizer: the run's tokenizer (encode tool output / user turns with it, never the policy's text);
    params: the run's sampling parameters; max_response_tokens: the budget after the prompt
    (model.max_seq_len - len(prompt_ids)); source: where the row came from (file:line or task row).
    """

    prompt: str
    prompt_ids: list[int]
    label: Any
    index: int
    tokenizer: Any
    params: SamplingParams
    max_response_tokens: int
    source: str = ""


@dataclass
class Trajectory:
    """Builds a hook's result: ``add_policy`` the samples ``generate`` returned (trained),
    ``add_env`` tool output / user turns (not trained); ``result(reward, metrics)`` is the dict."""

    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    truncated: bool = False

    def add_policy(self, sample: RolloutSample) -> None:
        self.response_ids += list(sample.response_ids)
        self.loss_mask += [1] * len(sample.response_ids)
        self.logprobs += list(sample.response_logprobs)
        self.truncated = sample.finish_reason == "length"

    def add_env(self, ids: Sequence[int]) -> None:
        self.response_ids += [int(i) for i in ids]
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def __len__(self) -> int:
        return len(self.response_ids)

    def result(self, reward: float | None = None, metrics: dict | None = None) -> dict:
        return dict(
            response_ids=list(self.response_ids),
            loss_mask=list(self.loss_mask),
            logprobs=list(self.logprobs),
            reward=reward,
            metrics=dict(metrics or {}),
            truncated=self.truncated,
        )


# -- loading and checking the hook --------------------------------------------------------------
def load_hook(spec: str) -> Callable:
    """The hook named by ``spec`` (``path/to/file.py:function`` or ``package.module:function``),
    checked to be callable as ``fn(generate, sample)``. Raises UserInputError naming the field."""
    from gspo_megatron.user_code import load_callable

    if not isinstance(spec, str) or ":" not in spec:
        raise UserInputError(f"{FIELD} {spec!r} must look like 'path/to/file.py:function'")
    file = spec.rpartition(":")[0]
    if file.endswith(".py") and not os.path.isfile(file):
        raise UserInputError(f"{FIELD}: file {file!r} does not exist (from {spec!r})")
    try:
        fn = load_callable(spec)
    except SyntaxError as e:
        raise UserInputError(f"{FIELD} {spec!r}: syntax error at {e.filename}:{e.lineno}: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - the user's module may raise anything while importing
        raise UserInputError(f"{FIELD} {spec!r}: {type(e).__name__}: {e}{_user_frame(e, spec)}") from None
    try:
        sig = inspect.signature(fn)
    except ValueError:  # no signature (a builtin): the call decides
        return fn
    try:
        sig.bind(None, None)
    except TypeError as e:
        raise UserInputError(
            f"{FIELD} {spec!r}: {getattr(fn, '__name__', spec)}{sig} cannot be called as fn(generate, sample): {e}"
        ) from None
    return fn


def _user_frame(e: BaseException, spec: str) -> str:
    """`` at file:line`` of the innermost frame in the hook's file (or the innermost frame)."""
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    path = os.path.abspath(spec.rpartition(":")[0])
    mine = [f for f in frames if os.path.abspath(f.filename) == path]
    f = (mine or frames)[-1]
    return f" at {f.filename}:{f.lineno}"


@dataclass
class _Call:
    """One generate request of one hook, answered by the dispatcher."""

    owner: int
    prompt_ids: list[int]
    params: SamplingParams
    result: RolloutSample | None = None
    error: BaseException | None = None
    done: bool = False


class EngineCallFailed(RuntimeError):
    """An engine call failed under a hook; ``cause`` is the engine's exception (re-raised as is, so
    that the rollout session can tell a dead engine from a broken hook)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"engine call failed: {type(cause).__name__}: {cause}")
        self.cause = cause


class _Dispatcher:
    """Gathers the generate calls of concurrently running hooks into batched engine calls.

    Each hook thread blocks in :meth:`generate`; the dispatching thread waits until every hook
    that has not finished is waiting, then sends the waiting requests (grouped by sampling params,
    in hook order) to the engine, one call per group with seed ``base_seed + call number``."""

    def __init__(self, engine, params: SamplingParams, num_hooks: int):
        self.engine, self.base_seed = engine, params.seed
        self.default_params = dataclasses.replace(params, seed=None)
        self.cv = threading.Condition()
        self.waiting: dict[int, _Call] = {}
        self.running = num_hooks
        self.engine_calls = 0
        self.calls: list[list[_Call]] = [[] for _ in range(num_hooks)]  # per hook, in call order

    def generate_for(self, owner: int) -> Callable[..., RolloutSample]:
        def generate(prompt_ids: Sequence[int], **overrides) -> RolloutSample:
            params = self.calls_params(overrides)
            ids = [int(t) for t in prompt_ids]
            if not ids:
                raise ValueError("generate: prompt_ids is empty")
            call = _Call(owner, ids, params)
            with self.cv:
                self.calls[owner].append(call)
                self.waiting[owner] = call
                self.cv.notify_all()
                while not call.done:
                    self.cv.wait()
            if call.error is not None:
                raise EngineCallFailed(call.error)
            if call.result is None:  # the dispatcher answers each call with a sample or an error
                raise RuntimeError("generate: the engine call ended without a sample")
            return call.result

        return generate

    def calls_params(self, overrides: dict) -> SamplingParams:
        names = {f.name for f in dataclasses.fields(SamplingParams)} - {"seed"}
        bad = sorted(set(overrides) - names)
        if bad:
            raise TypeError(f"generate() got unknown sampling parameter(s) {bad}; allowed: {sorted(names)}")
        return dataclasses.replace(self.default_params, **overrides)

    def finished(self) -> None:
        with self.cv:
            self.running -= 1
            self.cv.notify_all()

    def serve(self) -> None:
        """Dispatcher loop (the calling thread) until every hook has finished."""
        while True:
            with self.cv:
                while self.running and len(self.waiting) < self.running:
                    self.cv.wait()
                if not self.running:
                    return
                batch = [self.waiting.pop(k) for k in sorted(self.waiting)]
            groups: dict[tuple, list[_Call]] = {}
            for c in batch:
                key = tuple(tuple(v) if isinstance(v, list) else v for v in dataclasses.astuple(c.params))
                groups.setdefault(key, []).append(c)
            for calls in groups.values():
                seed = None if self.base_seed is None else (self.base_seed + 7919 * self.engine_calls) % (2**31)
                self.engine_calls += 1
                params = dataclasses.replace(calls[0].params, seed=seed)
                try:
                    out = self.engine.generate([c.prompt_ids for c in calls], 1, params)
                    if len(out) != len(calls):
                        raise RuntimeError(f"engine returned {len(out)} groups for {len(calls)} prompts")
                    for c, g in zip(calls, out):
                        c.result = g[0]
                except BaseException as e:  # noqa: BLE001 - handed to the hook, re-raised by the caller
                    for c in calls:
                        c.error = e
                with self.cv:
                    for c in calls:
                        c.done = True
                    self.cv.notify_all()


def run_hooks(
    hook: Callable, spec: str, engine, samples: Sequence[HookSample], params: SamplingParams
) -> tuple[list[dict], list[list[_Call]]]:
    """Call ``hook(generate, sample)`` for every sample concurrently (one thread each), their
    generate calls batched (see :class:`_Dispatcher`). Returns (results, each sample's calls).
    A hook that raises: UserInputError naming the field, the row and file:line; an engine failure
    under a hook is re-raised as the engine's own exception."""
    disp = _Dispatcher(engine, params, len(samples))
    results: list[Any] = [None] * len(samples)
    errors: list[BaseException | None] = [None] * len(samples)

    def run(i: int) -> None:
        try:
            results[i] = hook(disp.generate_for(i), samples[i])
        except BaseException as e:  # noqa: BLE001 - reported below, in sample order
            errors[i] = e
        finally:
            disp.finished()

    threads = [
        threading.Thread(target=run, args=(i,), daemon=True, name=f"rollout-hook-{i}") for i in range(len(samples))
    ]
    for t in threads:
        t.start()
    disp.serve()
    for t in threads:
        t.join()
    for i, e in enumerate(errors):
        if isinstance(e, EngineCallFailed):
            raise e.cause
    for i, e in enumerate(errors):
        if e is not None:
            raise UserInputError(
                f"{FIELD} {spec!r} raised on {samples[i].source or f'sample {i}'}: "
                f"{type(e).__name__}: {e}{_user_frame(e, spec)}"
            ) from None
    return results, disp.calls


# -- checking a hook's result -------------------------------------------------------------------
def check_result(result: Any, sample: HookSample, calls: Sequence[_Call], spec: str) -> Sample:
    """Validate one hook result (the documented dict) against the calls the hook made and convert it
    to the trainer's record, a :class:`~gspo_megatron.sample.Sample` with ``engine_logprobs`` [R]
    (the engine's log-probs on trained tokens, 0 elsewhere), ``loss_mask``, ``reward`` (None: left to
    reward.function), ``metrics``, ``finish_reason`` ("length" when truncated) and
    ``generate_calls``. Raises UserInputError naming the field and the offending key."""
    where = f"{FIELD} {spec!r} (on {sample.source or f'sample {sample.index}'})"
    if not isinstance(result, dict):
        raise UserInputError(
            f"{where} returned {type(result).__name__}, expected a dict with response_ids, "
            "loss_mask, reward (see gspo_megatron/engines/custom.py)"
        )
    missing = [k for k in ("response_ids", "loss_mask") if k not in result]
    if missing:
        raise UserInputError(f"{where} returned a dict without {missing}; it has {sorted(result)}")
    ids, mask = result["response_ids"], result["loss_mask"]
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise UserInputError(f"{where}: response_ids must be a list of int token ids")
    if not isinstance(mask, (list, tuple)) or len(mask) != len(ids):
        n = len(mask) if isinstance(mask, (list, tuple)) else type(mask).__name__
        raise UserInputError(f"{where}: loss_mask has {n} entries for {len(ids)} response_ids (one 0/1 per token)")
    if any(m not in (0, 1) for m in mask):
        raise UserInputError(f"{where}: loss_mask entries must be 0 or 1")
    if not ids:
        raise UserInputError(f"{where}: response_ids is empty")
    if len(ids) > sample.max_response_tokens:
        raise UserInputError(
            f"{where}: {len(ids)} response tokens exceed the budget of {sample.max_response_tokens} "
            f"(model.max_seq_len - prompt length; sample.max_response_tokens)"
        )
    lps = result.get("logprobs")
    if lps is not None and (not isinstance(lps, (list, tuple)) or len(lps) != len(ids)):
        n = len(lps) if isinstance(lps, (list, tuple)) else type(lps).__name__
        raise UserInputError(f"{where}: logprobs has {n} entries for {len(ids)} response_ids")
    engine_lps = match_sampled(list(ids), list(mask), calls)
    if isinstance(engine_lps, str):
        raise UserInputError(f"{where}: {engine_lps}")
    if lps is not None:
        for t, (m, a, b) in enumerate(zip(mask, lps, engine_lps)):
            if m and not math.isclose(float(a), b, rel_tol=0, abs_tol=1e-6):
                raise UserInputError(f"{where}: logprobs[{t}] = {a} is not the engine's log-prob {b} of that token")
    reward = result.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise UserInputError(f"{where}: reward must be a finite number or None, got {reward!r:.40}")
        reward = float(reward)
    metrics = result.get("metrics") or {}
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in metrics.items()
    ):
        raise UserInputError(f"{where}: metrics must be a dict of str -> number")
    truncated = result.get("truncated")
    if truncated is None:
        truncated = bool(calls) and calls[-1].result is not None and calls[-1].result.finish_reason == "length"
    # routing replay r3: each position's route from the call that ran it (tool output: the next call's prefill)
    routes = compose_routes(
        list(sample.prompt_ids) + [int(t) for t in ids],
        [(c.prompt_ids, c.result.response_ids, c.result.routed_experts) for c in calls if c.result is not None],
    )
    # DSA models: the indexer's selection composes the same way (query t's keys depend on tokens 0..t only)
    indexer = compose_routes(
        list(sample.prompt_ids) + [int(t) for t in ids],
        [
            (c.prompt_ids, c.result.response_ids, getattr(c.result, "indexer_topk", None))
            for c in calls
            if c.result is not None
        ],
    )
    return Sample(
        prompt_ids=list(sample.prompt_ids),
        response_ids=[int(t) for t in ids],
        loss_mask=[int(m) for m in mask],
        engine_logprobs=engine_lps,
        reward=reward,
        metrics={k: float(v) for k, v in metrics.items()},
        finish_reason="length" if truncated else "stop",
        generate_calls=len(calls),
        routed_experts=routes,
        indexer_topk=indexer,
    )


def match_sampled(ids: list[int], mask: list[int], calls: Sequence[_Call]) -> list[float] | str:
    """The engine log-prob of every trained token (0.0 on the others), or a message saying which
    trained token is not what the engine sampled.

    The trained tokens come in runs (maximal stretches of loss_mask == 1). Read in order they must be
    the sampled outputs of ``calls`` in call order: each call's output whole, or cut short where a
    run ends; a call may be left out (one whose output does not continue the run)."""
    out = [0.0] * len(ids)
    runs, t = [], 0
    while t < len(ids):
        if mask[t]:
            s = t
            while t < len(ids) and mask[t]:
                t += 1
            runs.append((s, t))
        else:
            t += 1
    ci = 0
    for s, e in runs:
        pos = s
        while pos < e:
            matched = False
            while ci < len(calls):
                sampled = calls[ci].result
                ci += 1
                if sampled is None:
                    continue
                got = sampled.response_ids
                k = 0
                while k < len(got) and pos + k < e and got[k] == ids[pos + k]:
                    k += 1
                if k == 0:
                    continue  # a call left out
                if k < len(got) and pos + k < e:
                    return (
                        f"trained token {pos + k} (response_ids[{pos + k}] = {ids[pos + k]}) is not what the "
                        f"engine sampled ({got[k]}): policy tokens must keep the engine's ids (never "
                        "re-tokenize the policy's text)"
                    )
                out[pos : pos + k] = [float(x) for x in sampled.response_logprobs[:k]]
                pos += k
                matched = True
                break
            if not matched:
                return (
                    f"trained tokens from response_ids[{pos}] on were not sampled by this sample's generate "
                    "calls (loss_mask=1 only on tokens generate() returned, in call order)"
                )
    return out


def dry_run(spec: str, row, tokenizer, max_seq_len: int, stop_id: int | None) -> None:
    """Preflight: load the hook, call it once on ``row`` (a PromptRow) with a stand-in engine that
    answers every call with the stop token (or one token 0), and check the result's shape.
    Raises UserInputError naming the field."""
    hook = load_hook(spec)
    tok = stop_id if stop_id is not None else 0

    class _StopEngine:
        def generate(self, prompts, n, params):
            return [
                [RolloutSample(list(p), [tok], [0.0], "stop" if stop_id is not None else "length") for _ in range(n)]
                for p in prompts
            ]

    params = SamplingParams(stop_token_ids=[] if stop_id is None else [stop_id])
    sample = HookSample(
        prompt=row.prompt,
        prompt_ids=list(row.prompt_ids),
        label=row.label,
        index=0,
        tokenizer=tokenizer,
        params=params,
        max_response_tokens=max_seq_len - len(row.prompt_ids),
        source=row.source,
    )
    results, calls = run_hooks(hook, spec, _StopEngine(), [sample], params)
    check_result(results[0], sample, calls[0], spec)
