"""Library side of tools/score.py: per-token log-probs of token sequences under a model.

Input rows (JSONL): ``{"input_ids": [ints]}``; output rows, same order: ``{"logprobs": [floats]}``
with log p(token_t | tokens_<t) for t = 1..n-1 (n - 1 values; none for a single token).

Data parallel: with world size = tp*pp*cp*dp, each chunk of rows is split over the DP replicas
(row i goes to replica i % dp; replicas are padded to the same number of rows, since expert
parallel spans replicas and every replica must run the same number of micro-batches). With a token
budget (``max_tokens_per_micro_batch`` > 0) rows are instead balanced over the replicas by tokens
and packed into micro-batches of whole rows (``gspo_megatron.trainer.packing``; replicas with fewer get
empty micro-batches). The last
pipeline stage's TP-rank-0 of each replica sends its results to global rank 0, which writes them
in input order.
"""

from __future__ import annotations

import json
import math
import os
from typing import Sequence

import torch
import torch.distributed as dist

from gspo_megatron.runtime import distributed as rdist


class InputError(ValueError):
    """A bad input row; the message names the file and line."""


def read_rows(path: str, vocab_size: int | None = None) -> list[list[int]]:
    """Token id lists of a JSONL file (any process). Raises InputError naming file:line."""
    if not os.path.isfile(path):
        raise InputError(f"input file {path} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict) or "input_ids" not in row:
                raise InputError(f"{where}: expected an object with an 'input_ids' list")
            ids = row["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise InputError(f"{where}: 'input_ids' must be a non-empty list of token ids")
            for j, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise InputError(f"{where}: input_ids[{j}] = {t!r} is not an integer")
                if t < 0 or (vocab_size is not None and t >= vocab_size):
                    raise InputError(f"{where}: input_ids[{j}] = {t} is outside the vocabulary [0, {vocab_size})")
            rows.append(ids)
    return rows


def _dp_info() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def _is_reporter() -> bool:
    """This rank holds a replica's final log-probs: last PP stage, TP rank 0, CP rank 0."""
    from megatron.core import parallel_state as ps

    return (
        ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
    )


@torch.no_grad()
def score_rows(
    model,
    rows: Sequence[Sequence[int]],
    micro_batch_size: int = 4,
    temperature: float = 1.0,
    pad_id: int = 0,
    max_tokens_per_micro_batch: int = 0,
    routes: Sequence | None = None,
    indexer: Sequence | None = None,
) -> list[list[float]] | None:
    """Log-probs of every row (collective: every rank passes the same ``rows``). Returns the
    per-row lists (input order) on global rank 0, None elsewhere. ``routes``: per row, the engine's
    routed experts int32 [len(row) - 1, layers, topk] (``engines/routing.py``), laid on the
    micro-batches for a model whose routing replay is in a replaying phase (the sync probe, r3)."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.trainer.micro_batches import (
        collate,
        compute_logprobs,
        gather_context_parallel,
        response_values,
        sequence_multiple,
        split_for_context_parallel,
    )

    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
    from gspo_megatron.sample import Sample
    from gspo_megatron.trainer.packing import (
        collate_packed,
        gather_packed_context_parallel,
        is_packed,
        plan_micro_batches,
    )

    def _sample(i: int) -> Sample:
        return Sample.from_tokens(
            rows[i],
            1,
            routed_experts=routes[i] if routes is not None else None,
            indexer_topk=indexer[i] if indexer is not None else None,
        )

    dp_rank, dp = _dp_info()
    cp = ps.get_context_parallel_world_size()
    cp_group = ps.get_context_parallel_group() if cp > 1 else None
    from megatron.core.utils import get_model_config

    mc = get_model_config(model)  # an FP8 model needs its rows padded for Transformer Engine's GEMMs
    multiple = sequence_multiple(
        ps.get_tensor_model_parallel_world_size(),
        cp,
        fp8=getattr(mc, "fp8", None),
        sp=getattr(mc, "sequence_parallel", None),
        fp8_recipe=getattr(mc, "fp8_recipe", None) or "delayed",
    )
    if max_tokens_per_micro_batch:
        seg = 2 * cp if cp > 1 else 1
        plan = plan_micro_batches([len(r) for r in rows], dp, max_tokens_per_micro_batch, seg)[dp_rank]
        batches = [
            collate_packed(
                [_sample(i) for i in idx], pad_id=pad_id, seg_multiple=seg, row_multiple=multiple, seq_ids=idx
            )
            for idx in plan
        ]
    else:
        per_replica = math.ceil(len(rows) / dp) if rows else 0
        mine = [i for i in range(len(rows)) if i % dp == dp_rank]
        # pad with a copy of row 0 (result dropped) so that every replica runs the same micro-batches
        slots = mine + [None] * (per_replica - len(mine))
        chunks = [slots[s : s + micro_batch_size] for s in range(0, len(slots), micro_batch_size)]
        batches = [
            collate(
                [_sample(i if i is not None else 0) for i in chunk], pad_id=pad_id, multiple=multiple, seq_ids=chunk
            )
            for chunk in chunks
        ]
    local = batches if cp_group is None else [split_for_context_parallel(b, cp_group) for b in batches]
    out = compute_logprobs(model, local, temperature=temperature)  # one pipelined schedule
    if out is not None and cp_group is not None:  # whole rows again on every CP rank
        out = [
            {
                "logprobs": gather_packed_context_parallel(o["logprobs"], b["cu_seqlens"], cp_group)
                if is_packed(b)
                else gather_context_parallel(o["logprobs"], cp_group)
            }
            for o, b in zip(out, batches)
        ]
    results: list[tuple[int, list[float]]] = []
    if out is not None and _is_reporter():
        for batch, res in zip(batches, out):
            for i, lp in zip(batch["seq_ids"], response_values(batch, res["logprobs"])):
                if i is not None:
                    results.append((i, lp))
    gathered: list | None = [results]
    if rdist.world_size() > 1:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(results if _is_reporter() else [], gathered, dst=0)
    if rdist.rank() != 0:
        return None
    assert gathered is not None  # rank 0 gathered every rank's part
    by_index = dict(item for part in gathered for item in part)
    missing = [i for i in range(len(rows)) if i not in by_index]
    if missing:
        raise RuntimeError(f"no log-probs came back for rows {missing[:5]}")
    return [by_index[i] for i in range(len(rows))]


def score_to_file(
    model,
    rows: Sequence[Sequence[int]],
    output_path: str,
    micro_batch_size: int = 4,
    temperature: float = 1.0,
    chunk_rows: int = 1024,
    max_tokens_per_micro_batch: int = 0,
) -> int:
    """Score ``rows`` (from ``read_rows``) into the JSONL ``output_path`` (collective; rank 0
    writes, atomically), ``chunk_rows`` rows at a time so that memory stays bounded.
    ``max_tokens_per_micro_batch`` > 0 packs rows (see :func:`score_rows`). Returns the number of rows."""
    rank0 = rdist.rank() == 0
    tmp = f"{output_path}.tmp"
    f = open(tmp, "w") if rank0 else None
    try:
        for start in range(0, len(rows), chunk_rows):
            res = score_rows(
                model,
                rows[start : start + chunk_rows],
                micro_batch_size,
                temperature,
                max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            )
            if f is not None:
                assert res is not None  # rank 0 (the one with the file) gets the rows
                for lp in res:
                    f.write(json.dumps({"logprobs": lp}) + "\n")
    finally:
        if f is not None:
            f.close()
    if rank0:
        os.replace(tmp, output_path)
    return len(rows)
