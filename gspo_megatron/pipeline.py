"""Micro-batches and Megatron forward(-backward) passes over the pipeline.

Every rank of a data-parallel replica receives the same micro-batches (the first stage reads the
tokens, the last stage the labels and loss inputs). Layout: right-padded rows [b, s] with causal
attention (padding sits after every real token, so it never influences them); ``s`` is rounded up
to a multiple of the tensor-parallel size for sequence parallelism.

Sequence record (one per sequence): ``tokens`` (prompt + response ids), ``prompt_len``, and optional
per-response-token lists ``old_logprobs``, ``engine_logprobs``, ``ref_logprobs``, ``loss_mask``
(0/1 per response token: multi-turn rollouts train only the policy's tokens, not tool output or user
turns; absent = every response token) and a scalar ``advantage``. Position t of a row predicts
token t+1, so response token j (0-based) is the label at position prompt_len - 1 + j.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import torch

PAD_LABEL = -100  # ignored by the log-prob function (log-prob 0, no gradient)


def collate(seqs: Sequence[dict], pad_id: int = 0, multiple: int = 1) -> dict:
    """Build one right-padded micro-batch from sequence records (see module docstring).

    Returns tokens/position_ids/labels [b, s] long, loss_mask [b, s] float (the record's
    ``loss_mask`` on its response, 0 on prompt and padding), seq_index [b, s] long, and
    old_logprobs / engine_logprobs / ref_logprobs [b, s] float and advantages [b] when present.
    """
    if not seqs:
        raise ValueError("collate needs at least one sequence")
    longest = max(len(s["tokens"]) for s in seqs)
    width = -(-longest // multiple) * multiple
    b = len(seqs)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    labels = torch.full((b, width), PAD_LABEL, dtype=torch.long)
    mask = torch.zeros(b, width)
    per_token = {k: torch.zeros(b, width) for k in ("old_logprobs", "engine_logprobs", "ref_logprobs")
                 if k in seqs[0]}
    for i, s in enumerate(seqs):
        ids = torch.as_tensor(s["tokens"], dtype=torch.long)
        n, p = ids.numel(), s["prompt_len"]
        if not 1 <= p <= n:
            raise ValueError(f"sequence {i}: prompt_len {p} outside [1, {n}]")
        tokens[i, :n] = ids
        labels[i, : n - 1] = ids[1:]
        mask[i, p - 1 : n - 1] = 1.0 if s.get("loss_mask") is None else _response_mask(s["loss_mask"], n - p, i)
        for k, t in per_token.items():
            vals = torch.as_tensor(s[k], dtype=torch.float32)
            if vals.numel() != n - p:
                raise ValueError(f"sequence {i}: {k} has {vals.numel()} values for {n - p} response tokens")
            t[i, p - 1 : n - 1] = vals
    batch = dict(
        tokens=tokens,
        position_ids=torch.arange(width).unsqueeze(0).expand(b, width).contiguous(),
        labels=labels,
        loss_mask=mask,
        seq_index=torch.arange(b).unsqueeze(1).expand(b, width).contiguous(),
        **per_token,
    )
    if "advantage" in seqs[0]:
        batch["advantages"] = torch.tensor([float(s["advantage"]) for s in seqs])
    return batch


def _response_mask(values, n: int, i: int) -> torch.Tensor:
    m = torch.as_tensor(values, dtype=torch.float32)
    if m.shape != (n,):
        raise ValueError(f"sequence {i}: loss_mask has {m.numel()} values for {n} response tokens")
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError(f"sequence {i}: loss_mask values must be 0 or 1")
    return m


def trained_tokens(record: dict) -> int:
    """Response tokens of a sequence record that the loss counts (its loss_mask's ones)."""
    m = record.get("loss_mask")
    return len(record["tokens"]) - record["prompt_len"] if m is None else int(sum(m))


TOKEN_KEYS = ("tokens", "position_ids", "labels", "loss_mask", "seq_index", "old_logprobs",
              "engine_logprobs", "ref_logprobs")


def sequence_multiple(tp: int, cp: int) -> int:
    """What a padded row length must divide: tp for sequence parallelism; 2*cp chunks per row (each
    a multiple of tp) for context parallelism's load-balanced split."""
    return tp * 2 * cp if cp > 1 else tp


def split_for_context_parallel(batch: dict, cp_group=None) -> dict:
    """This context-parallel rank's share of every [b, s] tensor: the row cut into 2*cp chunks, rank
    r keeping chunks r and 2*cp-1-r (Megatron's get_batch_on_this_cp_rank, the layout its CP
    attention expects). Other keys (advantages, normalizer) are kept whole."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    local = get_batch_on_this_cp_rank({k: batch[k] for k in TOKEN_KEYS if k in batch}, cp_group)
    return {**batch, **local}


def gather_context_parallel(local: torch.Tensor, cp_group) -> torch.Tensor:
    """Inverse of ``split_for_context_parallel`` for one [b, s/cp] tensor: all-gather over the CP
    group and put the chunks back in order. Every CP rank calls it; all get [b, s]."""
    import torch.distributed as dist

    cp = dist.get_world_size(cp_group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=cp_group)
    chunks = [None] * (2 * cp)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=1)
        chunks[r], chunks[2 * cp - 1 - r] = first, second
    return torch.cat(chunks, dim=1)


def response_values(batch: dict, values: torch.Tensor) -> list[list[float]]:
    """Per-sequence lists of ``values`` [b, s] at the response positions (loss_mask == 1)."""
    mask = batch["loss_mask"].to(values.device).bool()
    return [row[m].tolist() for row, m in zip(values, mask)]


def to_device(batch: dict) -> dict:
    """The batch's tensors on this rank's compute device (a no-op on CPU)."""
    from gspo_megatron.runtime.distributed import device

    dev = device()
    return {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _forward_step(loss_func_factory: Callable[[dict], Callable], data_iterator, model):
    batch = to_device(next(data_iterator))
    logits = model(batch["tokens"], batch["position_ids"], attention_mask=None)
    return logits, loss_func_factory(batch)


def run_schedule(model, batches: list[dict], loss_func_factory: Callable[[dict], Callable],
                 forward_only: bool) -> list:
    """Run Megatron's forward-backward schedule (1F1B with PP>1) over ``batches``. Every rank of the
    model-parallel group calls it with the same batches. Returns what the loss functions reported
    (non-empty on the last pipeline stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not batches:
        return []
    seq_len = max(b["tokens"].shape[1] for b in batches)
    mbs = max(b["tokens"].shape[0] for b in batches)
    fb = get_forward_backward_func()
    return fb(
        forward_step_func=partial(_forward_step, loss_func_factory),
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=seq_len,
        micro_batch_size=mbs,
        forward_only=forward_only,
    )


@torch.no_grad()
def compute_logprobs(model, batches: list[dict], temperature: float = 1.0,
                     with_entropy: bool = False) -> list[dict] | None:
    """Per-token log-probs [b, s] of each batch's labels (vocab-parallel, no vocab gather). Returns
    the list of {"logprobs", ("entropy")} per batch on the last pipeline stage, None elsewhere."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.losses.megatron_loss import make_megatron_logprob_func

    was_training = model.training
    model.eval()
    try:
        out = run_schedule(
            model, batches,
            lambda b: make_megatron_logprob_func(
                b, tp_group=ps.get_tensor_model_parallel_group(), temperature=temperature,
                with_entropy=with_entropy),
            forward_only=True)
    finally:
        model.train(was_training)
    return out if ps.is_pipeline_last_stage() else None

