"""Micro-batches and Megatron forward(-backward) passes over the pipeline.

Every rank of a data-parallel replica receives the same micro-batches (the first stage reads the
tokens, the last stage the labels and loss inputs). Layout: right-padded rows [b, s] with causal
attention (padding sits after every real token, so it never influences them); ``s`` is rounded up
to ``sequence_multiple`` (the tensor-parallel size for sequence parallelism; 2*cp*tp with context
parallelism; with FP8 also what Transformer Engine's GEMMs need on every rank). Or packed: whole sequences
concatenated in one row with per-sequence positions and attention (``gspo_megatron.trainer.packing``); the
forward step passes such a micro-batch's ``PackedSeqParams`` to the model.

The sequences are :class:`gspo_megatron.sample.Sample` records (prompt and response ids, optional
per-response-token ``old_logprobs``, ``engine_logprobs``, ``ref_logprobs``, ``behaviour_version``,
``loss_mask``, and the scalar ``advantage``). Position t of a row predicts token t+1, so response token
j (0-based) is the label at position prompt_len - 1 + j.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Sequence

import torch

from gspo_megatron.sample import PER_TOKEN_FIELDS, Sample
from gspo_megatron.trainer import route_replay
from gspo_megatron.trainer.packing import (
    INDEXER_KEY,
    PAD_LABEL,
    ROUTES_KEY,
    TOKEN_KEYS,
    advantages_of,
    lay_routes,
    lay_teacher_topk,
    per_token_values,
    response_mask,
)


def collate(seqs: Sequence[Sample], pad_id: int = 0, multiple: int = 1, seq_ids: Sequence | None = None) -> dict:
    """Build one right-padded micro-batch from Samples (see module docstring).

    Returns tokens/position_ids/labels [b, s] long, loss_mask [b, s] float (the Sample's
    ``loss_mask`` on its response, 0 on prompt and padding), seq_index [b, s] long, and
    old_logprobs / engine_logprobs / ref_logprobs / behaviour_version [b, s] float and advantages [b]
    when the first Sample carries them;
    num_seqs (b), num_real_tokens (sum of the sequence lengths), seq_lens (each row's sequence
    length, list of b ints: what a DSA model's indexer needs, :func:`row_padding_mask`) and seq_ids
    (the caller's id of each row; default 0..b-1); ``routed_experts`` int32 [b, s, L, K] when the Samples carry the
    engine's routes (``trainer.packing.lay_routes``: token t's route at position t, NO_ROUTE on the
    last token and the right padding).
    """
    if not seqs:
        raise ValueError("collate needs at least one sequence")
    longest = max(s.length for s in seqs)
    width = -(-longest // multiple) * multiple
    b = len(seqs)
    tokens = torch.full((b, width), pad_id, dtype=torch.long)
    labels = torch.full((b, width), PAD_LABEL, dtype=torch.long)
    mask = torch.zeros(b, width)
    per_token = {k: torch.zeros(b, width) for k in PER_TOKEN_FIELDS if getattr(seqs[0], k) is not None}
    for i, s in enumerate(seqs):
        ids = torch.as_tensor(s.tokens, dtype=torch.long)
        n, p = ids.numel(), s.prompt_len
        if not 1 <= p <= n:
            raise ValueError(f"sequence {i}: prompt_len {p} outside [1, {n}]")
        tokens[i, :n] = ids
        labels[i, : n - 1] = ids[1:]
        mask[i, p - 1 : n - 1] = 1.0 if s.loss_mask is None else response_mask(s.loss_mask, n - p, i)
        for k, t in per_token.items():
            t[i, p - 1 : n - 1] = per_token_values(s, k, i)
    batch = dict(
        tokens=tokens,
        position_ids=torch.arange(width).unsqueeze(0).expand(b, width).contiguous(),
        labels=labels,
        loss_mask=mask,
        seq_index=torch.arange(b).unsqueeze(1).expand(b, width).contiguous(),
        **per_token,
        num_seqs=b,
        num_real_tokens=sum(s.length for s in seqs),
        seq_lens=[s.length for s in seqs],
        seq_ids=list(seq_ids) if seq_ids is not None else list(range(b)),
    )
    for key in (ROUTES_KEY, INDEXER_KEY):
        routes = lay_routes(seqs, b, width, [(i, 0) for i in range(b)], key)
        if routes is not None:
            batch[key] = routes
    batch.update(lay_teacher_topk(seqs, b, width, [(i, 0) for i in range(b)]))
    if seqs[0].advantage is not None:
        batch["advantages"] = advantages_of(seqs)
    return batch


def fp8_alignment(recipe: str = "delayed") -> int:
    """Transformer Engine 2.20.2's alignment, in tokens, of an FP8 GEMM's token dimension: 16, 32 for
    MXFP8 (``recipe``: ``model.fp8_recipe``).

    Read from TE's source (transformer_engine/pytorch/):
    - ``utils.py`` ``assert_dim_for_fp8_exec`` (called by ``module/linear.py`` ``_Linear.forward``,
      ``layernorm_linear.py``, ``layernorm_mlp.py`` whenever fp8 is on, on the rank's local input
      before any sequence-parallel all-gather): the product of all dims but the last (the tokens)
      divisible by 8, the last dim divisible by 16. The weight-gradient GEMM consumes the transposed
      FP8 input, whose last dim is the token dim: hence 16 for the tokens too;
    - ``quantization.py`` ``get_align_size_for_quantization``: 32 for MXFP8 (its 1x32 scaling
      blocks, ``constants.MXFP8_BLOCK_SCALING_SIZE``), 16 for the other built-in recipes; what
      ``module/fp8_padding.py`` pads each grouped-GEMM split to.
    Megatron-Core 0.16.1 agrees: ``fp8_utils.get_fp8_align_size`` (32 for mxfp8, else 16), the padding
    its multimodal models apply for FP8 (``models/multimodal/context_parallel.py``)."""
    return 32 if recipe == "mxfp8" else 16


def sequence_multiple(
    tp: int, cp: int, fp8: str | bool | None = None, sp: bool | None = None, fp8_recipe: str = "delayed"
) -> int:
    """What a padded row's length (a packed row's total length) must divide.

    - sequence parallelism: tp (each TP rank holds s/tp positions);
    - context parallelism: 2*cp chunks per row (each a multiple of tp), the load-balanced split;
    - FP8 (``fp8`` set): the token dim of every Transformer Engine GEMM on every rank is a multiple
      of ``fp8_alignment(fp8_recipe)`` = A. The fewest tokens a rank feeds a GEMM is its share of the
      row after the CP split (s/cp) and, with sequence parallelism (``sp``; None: on when tp > 1,
      as ``models.build`` resolves it), the SP scatter (s/(cp*tp)): the column-parallel layers'
      local input. Row-parallel layers see s/cp (a multiple of that). So s must be a multiple of
      A*cp*tp (A*cp without SP), whatever the micro-batch's number of rows b (b*s/... is then one).
      MoE experts: Megatron pads each expert's token count itself (TEGroupedMLP's ``Fp8Padding``,
      and ``moe_router_padding_for_quantization``, which ``runtime.fp8`` sets).
    Padding positions carry loss_mask 0 and sit after the real tokens (or in their own packed
    segment), so the loss and the real tokens' log-probs do not change."""
    base = tp * 2 * cp if cp > 1 else tp
    if not fp8:
        return base
    sp_size = tp if (tp > 1 if sp is None else sp) else 1
    return math.lcm(base, fp8_alignment(fp8_recipe) * cp * sp_size)


def split_for_context_parallel(batch: dict, cp_group=None) -> dict:
    """This context-parallel rank's share of every [b, s] tensor: the row cut into 2*cp chunks, rank
    r keeping chunks r and 2*cp-1-r (Megatron's get_batch_on_this_cp_rank, the layout its CP
    attention expects). Other keys (advantages, normalizer) are kept whole. A packed micro-batch is
    cut per segment instead (``trainer.packing.split_packed_for_context_parallel``, TE's THD layout)."""
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    from gspo_megatron.trainer.packing import is_packed, split_packed_for_context_parallel

    if is_packed(batch):
        if cp_group is None:
            from megatron.core import parallel_state as ps

            cp_group = ps.get_context_parallel_group()
        return split_packed_for_context_parallel(batch, dist.get_world_size(cp_group), dist.get_rank(cp_group))

    local = get_batch_on_this_cp_rank({k: batch[k] for k in TOKEN_KEYS if k in batch}, cp_group)
    return {**batch, **local}


def gather_context_parallel(local: torch.Tensor, cp_group) -> torch.Tensor:
    """Inverse of ``split_for_context_parallel`` for one [b, s/cp] tensor: all-gather over the CP
    group and put the chunks back in order. Every CP rank calls it; all get [b, s]."""
    import torch.distributed as dist

    cp = dist.get_world_size(cp_group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=cp_group)
    halves = [part.chunk(2, dim=1) for part in parts]  # CP rank r holds chunks r and 2 * cp - 1 - r
    chunks = [first for first, _ in halves] + [second for _, second in reversed(halves)]
    return torch.cat(chunks, dim=1)


def response_values(batch: dict, values: torch.Tensor) -> list[list[float]]:
    """Per-sequence lists (seq_ids order) of ``values`` [b, s] at the response positions
    (loss_mask == 1), for padded and packed micro-batches."""
    from gspo_megatron.trainer.packing import sequence_values

    return sequence_values(batch, values)


def to_device(batch: dict) -> dict:
    """The batch's tensors on this rank's compute device (a no-op on CPU)."""
    from gspo_megatron.runtime.distributed import device

    dev = device()
    return {k: v.to(dev, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def row_padding_mask(model, batch: dict) -> torch.Tensor | None:
    """The ``attention_mask`` a padded micro-batch passes to the model: None (causal attention alone;
    right padding never influences a real token), except for a model with DeepSeek Sparse Attention
    (``experimental_attention_variant == "dsa"``), whose indexer must see each row's sequence alone:
    its top-k breaks exact ties by the length of the row it runs on (``models/deepseek_v32/indexer.py``).
    Then a key-padding mask [b, 1, 1, s] bool, True at key t >= the row's ``seq_lens`` (right padding);
    the DSA core attention reads the lengths from it and builds its own causal mask."""
    from megatron.core.utils import get_model_config

    from gspo_megatron.trainer.packing import is_packed

    if is_packed(batch) or getattr(get_model_config(model), "experimental_attention_variant", None) != "dsa":
        return None
    if "seq_lens" not in batch:
        raise ValueError("a padded micro-batch for a DSA model needs seq_lens (trainer.micro_batches.collate)")
    b, s = batch["tokens"].shape
    lens = torch.as_tensor(batch["seq_lens"], device=batch["tokens"].device).view(b, 1)
    return (torch.arange(s, device=lens.device).view(1, s) >= lens).view(b, 1, 1, s)


def _forward_step(
    loss_func_factory: Callable[[dict], Callable], fused_logprobs: bool, with_drafts: bool, data_iterator, model
):
    from gspo_megatron.losses.mtp_loss import DraftStates
    from gspo_megatron.models.lm_head import lm_forward, mtp_output_weight
    from gspo_megatron.trainer.packing import packed_seq_params

    raw = next(data_iterator)
    batch = to_device(raw)  # a new dict: r2's record is kept in ``raw`` too (after_forward)
    route_replay.before_forward(model, batch)  # routing replay (rollout.routing_replay): this batch's targets
    psp = packed_seq_params(batch)
    drafts: list | None = [] if with_drafts else None  # the MTP layers' states (models/mtp.py), last stage
    # fused: hidden states [b, s, H] + the output weight shard, bound to the loss function
    output, weight = lm_forward(
        model,
        batch["tokens"],
        batch["position_ids"],
        fused=fused_logprobs,
        attention_mask=row_padding_mask(model, batch),
        packed_seq_params=psp,
        drafts=drafts,
    )
    route_replay.after_forward(model, batch, keep_in=raw, output=output)  # recompute in backward replays too
    bound: dict = {} if weight is None else {"output_weight": weight}
    if drafts:  # detached: the draft's loss and acceptance never move the output layer (losses/mtp_loss.py)
        bound["drafts"] = DraftStates(drafts, mtp_output_weight(model), psp)
    loss_func = loss_func_factory(batch)
    return output, (partial(loss_func, **bound) if bound else loss_func)


def run_schedule(
    model,
    batches: list[dict],
    loss_func_factory: Callable[[dict], Callable],
    forward_only: bool,
    fused_logprobs: bool = True,
    with_drafts: bool = False,
) -> list:
    """Run Megatron's forward-backward schedule (1F1B with PP>1) over ``batches``. Every rank of the
    model-parallel group calls it with the same batches. Returns what the loss functions reported
    (non-empty on the last pipeline stage only). ``fused_logprobs`` (config ``model.fused_logprobs``):
    the last stage hands the loss function hidden states and the output weight instead of logits
    (``gspo_megatron.models.lm_head``); the loss functions of ``losses.megatron_loss`` take either.
    ``with_drafts``: the model also runs its MTP layers (``model.mtp``) and binds their states to the
    loss function (``drafts``: a ``losses.mtp_loss.DraftStates``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not batches:
        return []
    seq_len = max(b["tokens"].shape[1] for b in batches)
    mbs = max(b["tokens"].shape[0] for b in batches)
    fb = get_forward_backward_func()
    return fb(
        forward_step_func=partial(_forward_step, loss_func_factory, fused_logprobs, with_drafts),
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=seq_len,
        micro_batch_size=mbs,
        forward_only=forward_only,
    )


@torch.no_grad()
def compute_logprobs(
    model,
    batches: list[dict],
    temperature: float = 1.0,
    with_entropy: bool = False,
    fused_logprobs: bool = True,
    with_drafts: bool = False,
) -> list[dict] | None:
    """Per-token log-probs [b, s] of each batch's labels (vocab-parallel, no vocab gather; with
    ``fused_logprobs`` no logits either). Returns the list of {"logprobs", ("entropy")} per batch on
    the last pipeline stage, None elsewhere; ``with_drafts`` (a model with MTP layers): each also
    holds the draft's ``draft_accept`` / ``draft_positions`` (``losses/mtp_loss.draft_acceptance``)."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.losses.megatron_loss import make_megatron_logprob_func

    was_training = model.training
    model.eval()
    try:
        out = run_schedule(
            model,
            batches,
            lambda b: make_megatron_logprob_func(
                b, tp_group=ps.get_tensor_model_parallel_group(), temperature=temperature, with_entropy=with_entropy
            ),
            forward_only=True,
            fused_logprobs=fused_logprobs,
            with_drafts=with_drafts,
        )
    finally:
        model.train(was_training)
    return out if ps.is_pipeline_last_stage() else None
