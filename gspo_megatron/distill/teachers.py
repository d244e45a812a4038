"""The distillation teachers of a run (rank 0): sglang servers that score the student's sampled tokens
by prefill only.

One scoring request is sglang's ``/generate`` over a batch of ``prompt + response`` id lists with
``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len`` = the prompt's length P minus one and
temperature 1 (the teacher's own distribution). sglang 0.5.23 answers
``meta_info["input_token_logprobs"]``: one ``[logprob, token_id, text]`` entry per input token from
``logprob_start_len`` on, entry j the log-prob of input token ``logprob_start_len + j`` given the
tokens before it, except that the first entry's log-prob is always None (the forward starts at
``logprob_start_len``, whose logits predict the next token:
``managers/scheduler_components/logprob_result_processor.py`` pads ``[None] + logprobs[:-1]``). So a
request from P - 1 answers R + 1 entries, a prompt token with None and then exactly the R response
tokens (checked: the ids must be the prompt's last and the response's).

:class:`TeacherPool` routes each group to its teacher (``distill.teacher_key``: the row's
``PromptRow.teacher``; else the only one), cuts a teacher's work into requests of
``distill.batch_size`` sequences, spreads them round-robin over the teacher's servers and runs them
in a thread pool: ``submit`` returns at once, so the teacher prefills a group while the student's
engines generate the next ones (``orchestration.batch`` joins them before the batch leaves rank 0).

Start-up (before the first step): each teacher must answer (``/server_info``) and share the
student's tokenizer: the same vocabulary (token -> id) and special tokens; the first difference is
named. A ``NAME=HF_DIR`` teacher is started here (``distill/teacher_servers.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from gspo_megatron.engines.sglang_client import SGLangError, SGLangHttpClient
from gspo_megatron.errors import UserInputError
from gspo_megatron.features.distill import TeacherSpec
from gspo_megatron.sample import Sample

logger = logging.getLogger(__name__)


def tokenizer_difference(student, teacher) -> str | None:
    """None when the two tokenizers map every token to the same id and have the same special tokens;
    else one phrase naming the first difference (by the student's id order)."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    for tok, i in sorted(sv.items(), key=lambda kv: kv[1]):
        if tv.get(tok) != i:
            where = "has no such token" if tok not in tv else f"has it as id {tv[tok]}"
            return f"the student's token {tok!r} (id {i}): the teacher {where}"
    extra = sorted(set(tv) - set(sv), key=lambda t: tv[t])
    if extra:
        return f"the teacher's token {extra[0]!r} (id {tv[extra[0]]}) is not in the student's vocabulary"
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        a, b = getattr(student, attr, None), getattr(teacher, attr, None)
        if a != b:
            return f"{attr}: student {a!r}, teacher {b!r}"
    return None


def check_teachers(specs: Sequence[TeacherSpec], student_tokenizer, timeout_s: float = 30.0) -> None:
    """Start-up (``preflight``, before any model is built): every running teacher server answers
    ``/server_info``, and every teacher's tokenizer (a started teacher's directory, a running one's
    reported ``tokenizer_path`` where readable here) is the student's. UserInputError naming the
    teacher otherwise."""
    from gspo_megatron.data.tokenizer import load_tokenizer

    for t in specs:
        paths = {t.model_path} if t.model_path is not None else set()
        if t.model_path is not None and not os.path.isdir(t.model_path):
            raise UserInputError(
                f"distill.teachers ({t.name}): {t.model_path!r} is neither an http(s) URL nor a model directory"
            )
        for url in t.urls:
            try:
                info = SGLangHttpClient(url, timeout_s=timeout_s).server_info()
            except SGLangError as e:
                raise UserInputError(f"distill.teachers ({t.name}): the teacher at {url} does not answer: {e}") from e
            paths.add(str(info.get("tokenizer_path") or info.get("model_path") or ""))
        for path in sorted(paths):
            if not path or not os.path.isdir(path):
                logger.warning(
                    "distill.teachers (%s): the teacher's tokenizer %r is not readable here; "
                    "its vocabulary was not compared with the student's",
                    t.name,
                    path,
                )
                continue
            try:
                teacher_tokenizer = load_tokenizer(path)
            except Exception as e:  # (one line naming the teacher)
                raise UserInputError(f"distill.teachers ({t.name}): no tokenizer can be loaded from {path}: {e}") from e
            diff = tokenizer_difference(student_tokenizer, teacher_tokenizer)
            if diff is not None:
                raise UserInputError(
                    f"distill.teachers ({t.name}): the teacher's tokenizer ({path}) is not the student's: {diff}"
                )


class Teacher:
    """One teacher: its name, its servers' clients (round-robin), and its counters."""

    def __init__(self, spec: TeacherSpec, urls: Sequence[str], timeout_s: float):
        self.name = spec.name
        self.clients = [SGLangHttpClient(u, timeout_s=timeout_s) for u in urls]
        self._next = 0
        self._lock = threading.Lock()

    def client(self) -> SGLangHttpClient:
        with self._lock:
            c = self.clients[self._next % len(self.clients)]
            self._next += 1
            return c


class TeacherPool:
    """Rank 0: see the module docstring. ``specs``: the parsed ``distill.teachers``; ``urls``: each
    teacher's server URLs (started ones included); the servers were checked at start-up
    (:func:`check_teachers`)."""

    def __init__(self, cfg, specs: Sequence[TeacherSpec], urls: dict[str, list[str]], started: Any = None):
        d = cfg.distill
        self.started = started  # distill.teacher_servers.StartedTeachers of the 'NAME=HF_DIR' teachers, or None
        self.batch_size = d.batch_size
        self.topk = d.topk  # the top-k objectives: the teacher's K most likely tokens per response position
        self.timeout_s = d.timeout_s
        self.teachers = {s.name: Teacher(s, urls[s.name], d.timeout_s) for s in specs}
        self.default = next(iter(self.teachers)) if len(self.teachers) == 1 else None
        workers = max(2, sum(len(t.clients) for t in self.teachers.values()) * 2)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="teacher")
        self._busy_s = 0.0
        self._stats_lock = threading.Lock()

    # -- scoring ----------------------------------------------------------------------------------
    def teacher_of(self, row) -> Teacher:
        name = getattr(row, "teacher", None) or self.default
        if name not in self.teachers:  # the dataset checks rows against the names (data.dataset._teacher_of)
            raise UserInputError(
                f"{getattr(row, 'source', 'a prompt')}: routed to teacher {name!r}; distill.teachers has "
                f"{', '.join(map(repr, self.teachers))}"
            )
        return self.teachers[name]

    def submit(self, row, records: list[Sample]) -> Future:
        """Score one group's Samples on ``row``'s teacher, in the background; the Future's result is
        None once every Sample's ``teacher_logprobs`` and ``teacher`` are set (its exception: a
        UserInputError naming the teacher, the server and ``distill.timeout_s``)."""
        teacher = self.teacher_of(row)
        chunks = [records[i : i + self.batch_size] for i in range(0, len(records), self.batch_size)]
        futures = [self._pool.submit(self._score, teacher, chunk) for chunk in chunks]
        done: Future = Future()

        def join(_f):
            if all(f.done() for f in futures) and not done.done():
                errors = [f.exception() for f in futures if f.exception() is not None]
                done.set_exception(errors[0]) if errors else done.set_result(None)

        for f in futures:
            f.add_done_callback(join)
        return done

    def score(self, row, records: list[Sample]) -> None:
        """:meth:`submit` and wait."""
        self.submit(row, records).result()

    def _score(self, teacher: Teacher, records: list[Sample]) -> None:
        client = teacher.client()
        t0 = time.perf_counter()
        payload = {
            "input_ids": [list(map(int, r.tokens)) for r in records],
            "sampling_params": [{"max_new_tokens": 0, "temperature": 1.0} for _ in records],
            "return_logprob": True,
            "logprob_start_len": [r.prompt_len - 1 for r in records],  # (module docstring: sglang's None pad)
        }
        if self.topk:
            payload["top_logprobs_num"] = self.topk
        try:
            out = client.post("generate", payload, timeout_s=self.timeout_s)
        except SGLangError as e:
            raise UserInputError(
                f"distill.teachers ({teacher.name}): scoring at {client.base_url} failed within "
                f"distill.timeout_s={self.timeout_s:g}: {e}"
            ) from e
        outs = out if isinstance(out, list) else [out]
        if len(outs) != len(records):
            raise UserInputError(
                f"distill.teachers ({teacher.name}): {client.base_url} gave {len(outs)} answers for {len(records)} inputs"
            )
        for rec, o in zip(records, outs):
            rec.teacher_logprobs = response_logprobs(o, rec, f"distill.teachers ({teacher.name}): {client.base_url}")
            rec.teacher = teacher.name
            if self.topk:
                who = f"distill.teachers ({teacher.name}): {client.base_url}"
                rec.teacher_topk_ids, rec.teacher_topk_logprobs = response_topk(o, rec, self.topk, who)
        with self._stats_lock:
            self._busy_s += time.perf_counter() - t0

    # -- metrics and lifetime ---------------------------------------------------------------------
    def take_busy_s(self) -> float:
        """Seconds spent in scoring requests (summed over requests) since the last call."""
        with self._stats_lock:
            s, self._busy_s = self._busy_s, 0.0
            return s

    def release(self) -> None:
        """Started GPU teachers free their memory while the student trains (``orchestration.colocation``)."""
        if self.started is not None:
            self.started.release()

    def resume(self) -> None:
        if self.started is not None:
            self.started.resume()

    def close(self) -> None:
        """Stop scoring and the servers this run started."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.started is not None:
            self.started.close()


def response_logprobs(out: dict, rec: Sample, who: str) -> list[float]:
    """The R response-token log-probs of one ``/generate`` answer asked with ``logprob_start_len`` =
    P - 1 (module docstring: R + 1 entries, the first a prompt token's None); UserInputError naming
    ``who`` (a teacher server answering out of contract) when they do not fit."""
    entries: list[Any] = (out.get("meta_info") or {}).get("input_token_logprobs") or []
    if len(entries) != rec.response_len + 1:
        raise UserInputError(
            f"{who}: {len(entries)} prompt log-probs for a response of {rec.response_len} tokens "
            "(expected the prompt's last token and one per response token, from logprob_start_len)"
        )
    if int(entries[0][1]) != int(rec.prompt_ids[-1]):
        raise UserInputError(f"{who}: the first scored token is not the prompt's last ({entries[0][1]})")
    entries = entries[1:]
    ids = [int(e[1]) for e in entries]
    # sglang reports ids >= vocab_size - 1 as 0 (logprob_result_processor.py clips image-token hashes)
    if any(i != int(t) and i != 0 for i, t in zip(ids, rec.response_ids)):
        raise UserInputError(
            f"{who}: the scored token ids are not the response's ({ids[:8]} vs {rec.response_ids[:8]})"
        )
    lps = [e[0] for e in entries]
    if any(v is None for v in lps):
        raise UserInputError(f"{who}: a response token has no log-prob (None)")
    return [float(v) for v in lps]


def response_topk(out: dict, rec: Sample, k: int, who: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [R, k], log-probs float32 [R, k]) of the teacher's k most likely tokens at each
    response position, from ``meta_info["input_top_logprobs"]`` (aligned with
    ``input_token_logprobs``: the first row, the prompt's last token, is sglang's None pad)."""
    rows: list[Any] = (out.get("meta_info") or {}).get("input_top_logprobs") or []
    if len(rows) != rec.response_len + 1 or any(r is None or len(r) != k for r in rows[1:]):
        raise UserInputError(
            f"{who}: input_top_logprobs does not hold {k} tokens for each of the {rec.response_len} response "
            "positions (top_logprobs_num)"
        )
    ids = np.array([[int(e[1]) for e in r] for r in rows[1:]], dtype=np.int32).reshape(rec.response_len, k)
    lps = np.array([[float(e[0]) for e in r] for r in rows[1:]], dtype=np.float32).reshape(rec.response_len, k)
    return ids, lps


def distill_metrics(records: Sequence[Sample], busy_s: float) -> dict[str, float]:
    """``distill/reverse_kl`` (mean over response tokens of engine - teacher log-prob: the k1 estimate
    of KL(student || teacher) on the student's own samples; the loss's ``distill_reverse_kl`` uses
    the trainer's old log-probs instead of the engine's), per teacher ``distill/reverse_kl/<name>``,
    ``distill/tokens`` and ``distill/teacher_score_s`` (seconds of scoring requests)."""
    sums: dict[str, list[float]] = {}
    for r in records:
        if r.teacher_logprobs is None or r.engine_logprobs is None:
            continue
        mask = r.loss_mask or [1] * r.response_len
        for e, t, m in zip(r.engine_logprobs, r.teacher_logprobs, mask):
            if m:
                acc = sums.setdefault(str(r.teacher), [0.0, 0.0])
                acc[0] += e - t
                acc[1] += 1
    if not sums:
        return {}
    total = sum(v[0] for v in sums.values())
    count = sum(v[1] for v in sums.values())
    out = {"distill/reverse_kl": total / max(count, 1.0), "distill/tokens": count, "distill/teacher_score_s": busy_s}
    out.update({f"distill/reverse_kl/{k}": v[0] / max(v[1], 1.0) for k, v in sums.items()})
    return out
