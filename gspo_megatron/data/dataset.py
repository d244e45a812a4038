"""Prompt datasets (.jsonl / .parquet / built-in tasks) and a resumable, seeded prompt sampler.

Used on global rank 0 (the rank that drives the rollout engine). Rows are validated and tokenized
when loaded, so a bad row fails before any heavy start, naming its file and line (or row).
Parquet files are read with pyarrow.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence, overload

from gspo_megatron.errors import UserInputError

if TYPE_CHECKING:
    from gspo_megatron.engines.base import RolloutSample


class DatasetError(UserInputError):
    """A malformed dataset row or file; the message names the file and line/row (and the config
    field involved: data.prompt_key, data.label_key, data.max_prompt_len)."""


@dataclass
class PromptRow:
    """One prompt: the raw text, the formatted text fed to the model, its token ids and its label.
    ``source`` says where it came from (``file:line`` or a task name and row). ``teacher``: the
    distillation teacher the row is routed to (the ``distill.teacher_key`` column), None without one."""

    prompt: str
    text: str
    prompt_ids: list[int]
    label: Any
    source: str
    teacher: str | None = None


def format_prompt(tokenizer, prompt: str, use_chat_template: bool = True) -> str:
    """Wrap ``prompt`` as one user turn with the tokenizer's chat template (when it has one and
    ``use_chat_template``), ending with the assistant generation prompt."""
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt


def encode_prompt(tokenizer, text: str, templated: bool) -> list[int]:
    """Token ids of a formatted prompt (a chat template already carries its own special tokens)."""
    return list(tokenizer.encode(text, add_special_tokens=not templated))


def decode_response(tokenizer, sample: "RolloutSample") -> str:
    """The response text given to reward functions: the final stop token (when generation stopped on
    one) is dropped; any other special token is kept, so a reward can see stray special tokens."""
    ids = sample.response_ids[:-1] if sample.finish_reason == "stop" else sample.response_ids
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _read_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    """Yield (location, record or an error message) per non-blank line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield f"line {line_no}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"line {line_no}", _Bad(f"invalid JSON ({e.msg} at column {e.colno})")


def _read_parquet(path: str) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq  # imported lazily: only parquet users need it

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own error types
        raise DatasetError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    for row_no, record in enumerate(table.to_pylist(), start=1):
        yield f"row {row_no}", record


@dataclass
class _Bad:
    reason: str


class PromptDataset(Sequence[PromptRow]):
    """A list of validated, tokenized prompts. ``skipped_rows`` counts rows dropped as malformed."""

    def __init__(self, rows: list[PromptRow], skipped_rows: int = 0, skip_reasons: list[str] | None = None):
        self.rows = rows
        self.skipped_rows = skipped_rows
        self.skip_reasons = skip_reasons or []

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> PromptRow: ...

    @overload
    def __getitem__(self, i: slice) -> list[PromptRow]: ...

    def __getitem__(self, i: int | slice) -> PromptRow | list[PromptRow]:
        return self.rows[i]

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        label_key: str | None = "label",
        max_prompt_tokens: int | None = None,
        use_chat_template: bool = True,
        skip_bad_rows: bool = False,
        teacher_route: tuple[str, tuple[str, ...]] | None = None,
    ) -> "PromptDataset":
        """Load ``path`` (.jsonl / .json lines, or .parquet). A malformed row raises
        :class:`DatasetError` naming file and line, or is skipped and counted when ``skip_bad_rows``.
        ``label_key=None``: rows carry no label. ``teacher_route``: (column, teacher names): each row's
        ``teacher`` is its value of the column (``distill.teacher_key``), one of the names."""
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"dataset file not found: {path}")
        if path.endswith(".parquet"):
            records = _read_parquet(path)
        elif path.endswith((".jsonl", ".json")):
            records = _read_jsonl(path)
        else:
            raise DatasetError(f"{path}: unsupported dataset format (expected .jsonl or .parquet)")
        return cls._build(
            ((f"{path} {loc}", rec) for loc, rec in records),
            tokenizer,
            prompt_key,
            label_key,
            max_prompt_tokens,
            use_chat_template,
            skip_bad_rows,
            path,
            teacher_route,
        )

    @classmethod
    def from_records(
        cls,
        records: Iterable[dict],
        tokenizer,
        *,
        source: str = "records",
        prompt_key: str = "prompt",
        label_key: str | None = "label",
        max_prompt_tokens: int | None = None,
        use_chat_template: bool = True,
        skip_bad_rows: bool = False,
        teacher_route: tuple[str, tuple[str, ...]] | None = None,
    ) -> "PromptDataset":
        """Build from in-memory rows (e.g. ``get_task(name).rows(n, seed)``)."""
        return cls._build(
            ((f"{source} row {i}", rec) for i, rec in enumerate(records, start=1)),
            tokenizer,
            prompt_key,
            label_key,
            max_prompt_tokens,
            use_chat_template,
            skip_bad_rows,
            source,
            teacher_route,
        )

    @classmethod
    def _build(
        cls,
        located,
        tokenizer,
        prompt_key,
        label_key,
        max_prompt_tokens,
        use_chat_template,
        skip_bad_rows,
        name,
        teacher_route=None,
    ) -> "PromptDataset":
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        templated = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
        rows: list[PromptRow] = []
        skipped: list[str] = []
        for where, record in located:
            try:
                row = _validate_row(where, record, tokenizer, prompt_key, label_key, max_prompt_tokens, templated)
                if teacher_route is not None:
                    row.teacher = _teacher_of(where, record, *teacher_route)
                rows.append(row)
            except DatasetError as e:
                if not skip_bad_rows:
                    raise
                skipped.append(str(e))
        if not rows and not skipped:
            raise DatasetError(f"{name}: the data file is empty (no rows)")
        if not rows:
            raise DatasetError(
                f"{name}: no usable rows ({len(skipped)} malformed rows skipped; the first: {skipped[0]})"
            )
        return cls(rows, skipped_rows=len(skipped), skip_reasons=skipped)


def _validate_row(where, record, tokenizer, prompt_key, label_key, max_prompt_tokens, templated) -> PromptRow:
    if isinstance(record, _Bad):
        raise DatasetError(f"{where}: {record.reason}")
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if prompt_key not in record:
        raise DatasetError(f"{where}: missing key {prompt_key!r} (data.prompt_key); the row has {_keys(record)}")
    prompt = record[prompt_key]
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: {prompt_key!r} must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise DatasetError(f"{where}: {prompt_key!r} is empty")
    if label_key is not None and label_key not in record:
        raise DatasetError(f"{where}: missing key {label_key!r} (data.label_key); the row has {_keys(record)}")
    text = format_prompt(tokenizer, prompt, templated)
    ids = encode_prompt(tokenizer, text, templated)
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise DatasetError(
            f"{where}: prompt has {len(ids)} tokens{' with the chat template' if templated else ''}, "
            f"more than data.max_prompt_len={max_prompt_tokens}"
        )
    label = record[label_key] if label_key is not None else None
    return PromptRow(prompt=prompt, text=text, prompt_ids=ids, label=label, source=where)


def _teacher_of(where: str, record: dict, column: str, names: tuple[str, ...]) -> str:
    """The row's teacher: its ``column`` value (``distill.teacher_key``), one of ``names``."""
    if column not in record:
        raise DatasetError(f"{where}: missing key {column!r} (distill.teacher_key); the row has {_keys(record)}")
    value = record[column]
    if not isinstance(value, str) or value not in names:
        raise DatasetError(
            f"{where}: {column!r} (distill.teacher_key) is {value!r}, which names no teacher; "
            f"distill.teachers has {', '.join(map(repr, names))}"
        )
    return value


def _keys(record: dict) -> str:
    keys = [str(k) for k in record][:8]
    return ("keys " + ", ".join(repr(k) for k in keys) + (", ..." if len(record) > 8 else "")) if keys else "no keys"


class PromptSampler:
    """Draws prompt indices epoch by epoch; each epoch's order is a function of (seed, epoch) only.

    Resumable: ``state_dict()`` = {"seed", "epoch", "index"} (index = position inside the epoch's order).
    A batch that crosses an epoch end continues with the next epoch's order. Called on rank 0 only.
    """

    def __init__(self, num_prompts: int, seed: int = 0, shuffle: bool = True):
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        self.num_prompts, self.seed, self.shuffle = num_prompts, seed, shuffle
        self.epoch, self.index = 0, 0
        self._order = self._order_for(0)

    def _order_for(self, epoch: int) -> list[int]:
        order = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(f"prompt-sampler:{self.seed}:{epoch}").shuffle(order)  # str seed: stable hash
        return order

    def next_indices(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` prompt indices."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        out: list[int] = []
        while len(out) < batch_size:
            if self.index >= self.num_prompts:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._order_for(self.epoch)
            take = min(batch_size - len(out), self.num_prompts - self.index)
            out += self._order[self.index : self.index + take]
            self.index += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index, "num_prompts": self.num_prompts}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_prompts", self.num_prompts) != self.num_prompts:
            raise ValueError(
                f"sampler state was saved for {state['num_prompts']} prompts, the dataset has {self.num_prompts}"
            )
        if not 0 <= int(state["index"]) <= self.num_prompts:
            raise ValueError(f"sampler state index {state['index']} out of range [0, {self.num_prompts}]")
        self.seed, self.epoch, self.index = int(state["seed"]), int(state["epoch"]), int(state["index"])
        self._order = self._order_for(self.epoch)
