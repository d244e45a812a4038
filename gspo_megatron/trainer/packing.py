"""Sequence packing: token-budget micro-batches of whole sequences, balanced over data-parallel ranks.

Layout of a packed micro-batch (``collate_packed``): ONE row [1, T] holding whole sequences back to
back, each in its own segment of ``cu_seqlens`` (int32 [K + 1], segment k = tokens
cu_seqlens[k]..cu_seqlens[k+1]). Positions restart at 0 in every segment; attention never crosses a
segment boundary (causal inside a segment). On GPU, Transformer Engine does this natively (THD with
cu_seqlens via Megatron-Core's ``PackedSeqParams``); without TE, ``models.packed_attention`` gives the
local attention the same semantics by running causal attention segment by segment (an exact
equivalent of a block-diagonal causal mask, so CPU CI
runs this very batching code). Rotary embeddings restart per segment in Megatron-Core's THD path.

Padding: with context parallelism each segment is padded at its end to a multiple of 2*cp (TE's THD
context parallelism splits every segment into 2*cp chunks); the row is completed to a multiple of
``row_multiple`` (tp for sequence parallelism, 2*cp*tp with CP) by one extra padding segment. Padding
sits after a segment's real tokens (causal: nothing real attends to it) or in its own segment, and
has loss_mask 0, so it changes no real token's log-prob, loss or gradient.

The per-token keys and their meaning are those of ``trainer.micro_batches.collate`` (labels, loss_mask,
seq_index, old/engine/ref log-probs); ``seq_index`` numbers the micro-batch's sequences 0..S-1
(padding: 0, masked). Extra keys: ``cu_seqlens``, ``max_seqlen``, ``num_seqs`` (S),
``num_real_tokens`` (sum of the sequences' lengths; for ``perf/padding_frac``) and ``seq_ids``
(the caller's id of each sequence, in seq_index order).

Balance (``plan_micro_batches``): sequences go to data-parallel ranks by longest-processing-time
first (longest first, each to the rank with the fewest tokens so far), so token counts per rank
differ by at most one sequence's length; then each rank packs its sequences first-fit decreasing
into micro-batches of at most ``budget`` tokens. Every rank computes the whole plan from the same
lengths (no collective), and ranks with fewer micro-batches get empty ones (one padding segment,
no loss tokens): Megatron's schedule and expert-parallel dispatch need the same count everywhere.
The loss stays exact for any grouping because it is normalized by the global count
(``losses.megatron_loss``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from gspo_megatron.sample import PER_TOKEN_FIELDS, Sample
from gspo_megatron.wire_format import NO_ROUTE

PAD_LABEL = -100
#: the engine's routed experts laid on a micro-batch: int32 [b, s, L, K] (``lay_routes``)
ROUTES_KEY = "routed_experts"
#: DSA models: the engine's indexer selection laid the same way: int32 [b, s, L, index_topk] of key
#: positions within each sequence (``lay_routes(..., attr="indexer_topk")``)
INDEXER_KEY = "indexer_topk"
# every [b, s(, ...)] tensor of a micro-batch (padded or packed): what a CP split or reorder must cut
TOPK_KEYS = ("teacher_topk_ids", "teacher_topk_logprobs")  # distill.topk: [b, s, K] at the label positions
TOKEN_KEYS = (
    "tokens",
    "position_ids",
    "labels",
    "loss_mask",
    "seq_index",
    *PER_TOKEN_FIELDS,
    ROUTES_KEY,
    INDEXER_KEY,
    *TOPK_KEYS,
)


def response_mask(values, n: int, i: int) -> torch.Tensor:
    """A Sample's ``loss_mask`` (0/1 per response token) as a float tensor [n]; ValueError naming
    sequence ``i`` when it has the wrong length or values."""
    m = torch.as_tensor(values, dtype=torch.float32)
    if m.shape != (n,):
        raise ValueError(f"sequence {i}: loss_mask has {m.numel()} values for {n} response tokens")
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError(f"sequence {i}: loss_mask values must be 0 or 1")
    return m


def per_token_values(s: Sample, key: str, i: int) -> torch.Tensor:
    """Sample field ``key`` (one of ``sample.PER_TOKEN_FIELDS``) as a float tensor [R]; ValueError
    naming sequence ``i`` when it is missing (the micro-batch's first Sample has it) or has the
    wrong length."""
    values = getattr(s, key)
    if values is None:
        raise ValueError(f"sequence {i}: {key} is None while the micro-batch's first sequence has one")
    vals = torch.as_tensor(values, dtype=torch.float32)
    if vals.numel() != s.response_len:
        raise ValueError(f"sequence {i}: {key} has {vals.numel()} values for {s.response_len} response tokens")
    return vals


def advantages_of(seqs: Sequence[Sample]) -> torch.Tensor:
    """The Samples' ``advantage`` as a float tensor [S]; ValueError naming the first one without."""
    values: list[float] = []
    for i, s in enumerate(seqs):
        if s.advantage is None:
            raise ValueError(f"sequence {i}: advantage is None while the micro-batch's first sequence has one")
        values.append(float(s.advantage))
    return torch.tensor(values)


def lay_routes(
    seqs: Sequence[Sample], rows: int, width: int, starts: Sequence[tuple[int, int]], attr: str = ROUTES_KEY
) -> torch.Tensor | None:
    """The Samples' ``routed_experts`` (int32 [n - 1, L, K] for a sequence of n tokens: the engine's
    route of token t in row t, ``engines/routing.py``) laid on a micro-batch: int32 [rows, width, L, K],
    sequence i's token t at row ``starts[i][0]``, position ``starts[i][1] + t``; NO_ROUTE (-1) on the
    last token of each sequence and on every padding position, so padding is never replayed. None
    when the first Sample has no routes; ValueError naming the sequence when another has none or a
    shape that does not fit its tokens. ``attr`` ``"indexer_topk"`` (:data:`INDEXER_KEY`): the DSA
    indexer selection [n - 1, L, index_topk], laid by the same rules (its values are key positions
    within the sequence, unchanged by the row offset)."""
    if not seqs or getattr(seqs[0], attr) is None:
        return None
    first = np.asarray(getattr(seqs[0], attr))
    if first.ndim != 3:
        raise ValueError(f"sequence 0: {attr} must be [tokens - 1, layers, topk], got shape {first.shape}")
    L, K = first.shape[1:]
    out = torch.full((rows, width, L, K), NO_ROUTE, dtype=torch.int32)
    for i, (s, (row, a)) in enumerate(zip(seqs, starts)):
        if getattr(s, attr) is None:
            raise ValueError(f"sequence {i}: {attr} is None while the micro-batch's first sequence has them")
        r = np.asarray(getattr(s, attr), dtype=np.int32)
        if r.shape != (s.length - 1, L, K):
            raise ValueError(
                f"sequence {i}: {attr} has shape {r.shape} for {s.length} tokens; expected "
                f"{(s.length - 1, L, K)} (the engine's values of tokens 0 .. n-2)"
            )
        out[row, a : a + s.length - 1] = torch.from_numpy(r)
    return out


def lay_teacher_topk(
    seqs: Sequence[Sample], rows: int, width: int, starts: Sequence[tuple[int, int]]
) -> dict[str, torch.Tensor]:
    """The Samples' teacher top-k (``teacher_topk_ids`` / ``_logprobs``, [R, K] each) on a micro-batch:
    ids long [rows, width, K] and log-probs float [rows, width, K], response token j of sequence i at
    row ``starts[i][0]``, position ``starts[i][1] + prompt_len - 1 + j`` (its label position); 0
    elsewhere (the loss mask keeps them out). Empty when the first Sample has none; ValueError naming
    the sequence when another has none or a shape that does not fit its response."""
    if not seqs or seqs[0].teacher_topk_ids is None:
        return {}
    K = np.asarray(seqs[0].teacher_topk_ids).shape[-1]
    ids = torch.zeros((rows, width, K), dtype=torch.long)
    lps = torch.zeros((rows, width, K), dtype=torch.float32)
    for i, (s, (row, a)) in enumerate(zip(seqs, starts)):
        if s.teacher_topk_ids is None or s.teacher_topk_logprobs is None:
            raise ValueError(f"sequence {i}: teacher_topk_ids is None while the micro-batch's first sequence has them")
        si, sl = np.asarray(s.teacher_topk_ids), np.asarray(s.teacher_topk_logprobs)
        if si.shape != (s.response_len, K) or sl.shape != si.shape:
            raise ValueError(
                f"sequence {i}: teacher top-k of shape {si.shape} / {sl.shape} for {s.response_len} response tokens"
            )
        lo = a + s.prompt_len - 1
        ids[row, lo : lo + s.response_len] = torch.from_numpy(si.astype(np.int64))
        lps[row, lo : lo + s.response_len] = torch.from_numpy(sl.astype(np.float32))
    return {TOPK_KEYS[0]: ids, TOPK_KEYS[1]: lps}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def balance_over_ranks(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices of ``lengths`` per rank (each list ascending), token counts balanced (LPT).

    Longest first, each sequence to the rank holding the fewest tokens (ties: lowest rank). The
    rank that ends up heaviest was the lightest when it took its last sequence, so the heaviest and
    lightest ranks differ by at most that sequence's length (<= the longest)."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    load = [0] * ranks
    out: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        out[r].append(i)
    return [sorted(o) for o in out]


def pack_first_fit(indices: Sequence[int], lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Micro-batches (lists of ``indices``, each ascending) of at most ``budget`` tokens, by
    first-fit decreasing. ``lengths[i]`` is the cost of index i (padded segment length)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        if lengths[i] > budget:
            raise ValueError(f"a sequence of {lengths[i]} tokens exceeds parallel.max_tokens_per_micro_batch={budget}")
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def plan_micro_batches(lengths: Sequence[int], ranks: int, budget: int, seg_multiple: int = 1) -> list[list[list[int]]]:
    """The whole plan, identical on every rank: plan[r] = rank r's micro-batches (index lists), all
    ranks with the same number of micro-batches (trailing empty lists for the lighter ranks).
    ``lengths`` are sequence lengths; each costs its length rounded up to ``seg_multiple``."""
    cost = [round_up(n, seg_multiple) for n in lengths]
    per_rank = [pack_first_fit(idx, cost, budget) for idx in balance_over_ranks(cost, ranks)]
    count = max(len(p) for p in per_rank)
    return [p + [[] for _ in range(count - len(p))] for p in per_rank]


def collate_packed(
    seqs: Sequence[Sample],
    pad_id: int = 0,
    seg_multiple: int = 1,
    row_multiple: int = 1,
    seq_ids: Sequence | None = None,
) -> dict:
    """One packed micro-batch (module docstring) from Samples (``gspo_megatron.sample``; as in
    ``trainer.micro_batches.collate``, the optional per-token fields and advantage of the first Sample decide
    which keys the batch has). An empty ``seqs``
    gives an empty micro-batch: one padding segment, num_seqs 1 with advantage 0, no loss tokens.

    Returns tokens/position_ids/labels/seq_index [1, T] long, loss_mask [1, T] float, the per-token
    float keys present in the Samples [1, T], advantages [S], cu_seqlens [K+1] int32, max_seqlen,
    num_seqs, num_real_tokens, seq_ids; ``routed_experts`` int32 [1, T, L, K] when the Samples carry
    routes (``lay_routes``)."""
    if row_multiple % seg_multiple:
        raise ValueError(f"row_multiple {row_multiple} must be a multiple of seg_multiple {seg_multiple}")
    segs = [round_up(s.length, seg_multiple) for s in seqs]
    used = sum(segs)
    total = max(round_up(used, row_multiple), row_multiple)
    bounds = [0]
    for n in segs:
        bounds.append(bounds[-1] + n)
    if total > used:
        bounds.append(total)  # the tail padding segment
    tokens = torch.full((total,), pad_id, dtype=torch.long)
    labels = torch.full((total,), PAD_LABEL, dtype=torch.long)
    position = torch.zeros(total, dtype=torch.long)
    seq_index = torch.zeros(total, dtype=torch.long)
    mask = torch.zeros(total)
    keys = [k for k in PER_TOKEN_FIELDS if seqs and getattr(seqs[0], k) is not None]
    per_token = {k: torch.zeros(total) for k in keys}
    for k in range(len(bounds) - 1):
        position[bounds[k] : bounds[k + 1]] = torch.arange(bounds[k + 1] - bounds[k])
    for i, s in enumerate(seqs):
        ids = torch.as_tensor(s.tokens, dtype=torch.long)
        n, p, a = ids.numel(), s.prompt_len, bounds[i]
        if not 1 <= p <= n:
            raise ValueError(f"sequence {i}: prompt_len {p} outside [1, {n}]")
        tokens[a : a + n] = ids
        labels[a : a + n - 1] = ids[1:]
        mask[a + p - 1 : a + n - 1] = 1.0 if s.loss_mask is None else response_mask(s.loss_mask, n - p, i)
        seq_index[a : a + segs[i]] = i
        for key, t in per_token.items():
            t[a + p - 1 : a + n - 1] = per_token_values(s, key, i)
    cu = torch.tensor(bounds, dtype=torch.int32)
    batch = dict(
        tokens=tokens[None],
        position_ids=position[None],
        labels=labels[None],
        loss_mask=mask[None],
        seq_index=seq_index[None],
        **{k: t[None] for k, t in per_token.items()},
        cu_seqlens=cu,
        max_seqlen=int((cu[1:] - cu[:-1]).max()),
        num_seqs=max(len(seqs), 1),
        num_real_tokens=sum(s.length for s in seqs),
        seq_ids=list(seq_ids) if seq_ids is not None else list(range(len(seqs))),
    )
    for key in (ROUTES_KEY, INDEXER_KEY):
        routes = lay_routes(seqs, 1, total, [(0, a) for a in bounds[: len(seqs)]], key)
        if routes is not None:
            batch[key] = routes
    batch.update({k: t for k, t in lay_teacher_topk(seqs, 1, total, [(0, a) for a in bounds[: len(seqs)]]).items()})
    if seqs and seqs[0].advantage is not None:
        batch["advantages"] = advantages_of(seqs)
    elif not seqs:
        batch["advantages"] = torch.zeros(1)
    return batch


def is_packed(batch: dict) -> bool:
    return "cu_seqlens" in batch


def packed_seq_params(batch: dict):
    """Megatron-Core's PackedSeqParams (THD) for a packed micro-batch already on its device; None
    for a padded one. Segments are already padded for CP, so cu_seqlens_*_padded = cu_seqlens."""
    if not is_packed(batch):
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"].to(torch.int32)
    n = int(batch["max_seqlen"])
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=n,
        max_seqlen_kv=n,
    )


def context_parallel_index(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Positions of the packed row that CP rank ``rank`` holds: every segment (a multiple of 2*cp
    long) cut into 2*cp chunks, the rank keeping chunks ``rank`` and ``2*cp-1-rank`` (the layout of
    TE's thd_get_partitioned_indices / Megatron's get_thd_batch_on_this_cp_rank)."""
    parts = []
    for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        if (b - a) % (2 * cp):
            raise ValueError(f"segment of {b - a} tokens is not a multiple of 2*cp = {2 * cp}")
        c = (b - a) // (2 * cp)
        parts += [
            torch.arange(a + rank * c, a + (rank + 1) * c),
            torch.arange(a + (2 * cp - 1 - rank) * c, a + (2 * cp - rank) * c),
        ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def split_packed_for_context_parallel(batch: dict, cp: int, rank: int) -> dict:
    """This CP rank's share of every [1, T] tensor of a packed micro-batch (other keys whole)."""
    idx = context_parallel_index(batch["cu_seqlens"].cpu(), cp, rank).to(batch["tokens"].device)
    return {**batch, **{k: batch[k].index_select(1, idx) for k in TOKEN_KEYS if k in batch}}


def gather_packed_context_parallel(local: torch.Tensor, cu_seqlens: torch.Tensor, cp_group) -> torch.Tensor:
    """Inverse of ``split_packed_for_context_parallel`` for one [1, T/cp] tensor (collective over
    ``cp_group``; every CP rank gets [1, T])."""
    import torch.distributed as dist

    cp = dist.get_world_size(cp_group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=cp_group)
    total = int(cu_seqlens[-1])
    out = local.new_zeros(local.shape[:-1] + (total,))
    for r, part in enumerate(parts):
        out[..., context_parallel_index(cu_seqlens.cpu(), cp, r).to(local.device)] = part
    return out


def sequence_values(batch: dict, values: torch.Tensor) -> list[list[float]]:
    """Per-sequence lists (seq_index order) of ``values`` [b, s] at the loss positions
    (loss_mask == 1), for padded and packed micro-batches alike."""
    mask = batch["loss_mask"].to(values.device).bool().reshape(-1)
    seq = batch["seq_index"].to(values.device).reshape(-1)
    flat = values.reshape(-1)
    n = int(batch.get("num_seqs", batch["tokens"].shape[0]))
    ids = batch.get("seq_ids")
    n = len(ids) if ids is not None else n
    return [flat[mask & (seq == i)].tolist() for i in range(n)]


def padding_counts(batches: Sequence[dict]) -> tuple[int, int]:
    """(computed tokens, real tokens) of micro-batches (whole rows, before any CP split)."""
    computed = sum(int(b["tokens"].numel()) for b in batches)
    real = sum(int(b["num_real_tokens"]) for b in batches)
    return computed, real
