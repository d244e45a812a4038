"""The MTP draft's loss and its acceptance on the step's own rollouts (``gspo.mtp_loss_coef``,
``rollout.speculative``; the draft's hidden states come from ``models.lm_head.lm_forward(drafts=...)``).

Notation: a micro-batch's ``labels`` [b, s] are the next tokens (``labels[i] = t[i+1]``), ``loss_mask``
[b, s] marks the response tokens among them. MTP layer k (1-based, M layers) at position i reads the
main model's hidden state of position i and the embedding of t[i+k] (through layers 1..k-1) and
predicts t[i+k+1] = ``labels[i+k]``: its targets are ``labels`` rolled left by k within each sequence
(``roll_left``: megatron-core's ``roll_tensor``, which zeroes what crosses a packed sequence's end).

- Targets counted (``draft_mask``): positions i with ``loss_mask[i] * loss_mask[i+k]`` (rolled): t[i+1]
  and t[i+k+1] are both response tokens, i.e. the token the draft reads was sampled by the engine, as
  in decoding, where a draft starts only after the target produced a token.
- Loss (:func:`mtp_loss_sum`): sum over k and counted positions of ``-log softmax(d_k[i] W^T)[t[i+k+1]]``
  (temperature 1, vocab-parallel, fused chunked head), divided by M by the caller. ``W`` is the output
  weight shard [V/tp, H], passed DETACHED with states the MTP block computed from the detached main
  hidden states and embeddings (models/mtp.py): the gradient reaches the MTP layers' own parameters only.
- Acceptance (:func:`draft_acceptance`): sglang 0.5.23 drafts top-1 chains (``--speculative-eagle-topk
  1``) and verifies with the target-only rule (``srt/speculative/eagle_utils.py``, the verify's
  ``tree_speculative_sampling_target_only`` with ``speculative_accept_threshold_single`` /
  ``_acc`` at their default 1.0; its chain form in ``dflash_utils.py``
  ``compute_dflash_sampling_correct_drafts_and_bonus``): greedy: accept while the draft token is the
  target's argmax; sampling: accept draft token d with probability q(d) (q: the target's distribution
  after temperature / top-k / top-p), else sample the token from relu(q - onehot(d)), which never
  holds d. On the realized trajectory both rules give: the first draft
  token of a chain is accepted exactly when the token the engine emitted equals the draft's proposal
  (a rejection never emits d). So the share of counted positions where argmax_v d_1[i] W^T equals
  t[i+2] is the draft's first-token acceptance on this rollout, exact, for either rule; the engine's
  own count (``spec/engine_accept_rate``) is the same rule over the positions where it drafted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_megatron.losses.fused_logprobs import fused_vocab_parallel_logprobs

_ARGMAX_CHUNK = 4096  # tokens per [n, V/tp] logits block of the acceptance's argmax


@dataclass(frozen=True)
class DraftStates:
    """What a forward that ran the model's MTP layers hands the loss functions (``trainer.micro_batches``):
    ``states``, MTP layer k's output [b, s, H] for k = 1..M; ``weight``, the output weight shard [V/tp, H],
    detached; ``packed_seq_params``, the micro-batch's (None for padded rows)."""

    states: list[Tensor]
    weight: Tensor
    packed_seq_params: Any = None


def roll_left(x: Tensor, k: int, packed_seq_params=None) -> Tensor:
    """``x`` [b, s] rolled left by ``k`` along the sequence, zeros shifted in at each sequence's end
    (packed rows: within each segment of ``packed_seq_params.cu_seqlens_q``)."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    for _ in range(k):
        x, _sum = roll_tensor(x, shifts=-1, dims=-1, packed_seq_params=packed_seq_params)
    return x


def draft_targets(labels: Tensor, loss_mask: Tensor, k: int, packed_seq_params=None) -> tuple[Tensor, Tensor]:
    """(targets [b, s] = t[i+k+1], mask [b, s] float) of MTP layer ``k`` (module docstring)."""
    targets = roll_left(labels, k, packed_seq_params)
    mask = loss_mask.float() * roll_left(loss_mask.float(), k, packed_seq_params)
    return targets, mask


def mtp_loss_sum(
    drafts: DraftStates,
    labels: Tensor,
    loss_mask: Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(sum over layers and counted positions of the draft's cross entropy, the count of (layer,
    position) terms), through ``drafts.weight`` (detached by the caller). Every TP rank calls it."""
    total = drafts.weight.new_zeros((), dtype=torch.float32)
    count = drafts.weight.new_zeros((), dtype=torch.float32)
    for k, hidden in enumerate(drafts.states, start=1):
        targets, mask = draft_targets(labels, loss_mask, k, drafts.packed_seq_params)
        logp, _ = fused_vocab_parallel_logprobs(
            hidden,
            drafts.weight,
            targets,
            tp_group=tp_group,
            temperature=1.0,
            chunk_size=chunk_size,
            with_entropy=False,
            vocab_size=vocab_size,
        )
        total = total - (logp.float() * mask).sum()
        count = count + mask.sum()
    return total, count


@torch.no_grad()
def vocab_parallel_argmax(
    hidden: Tensor, weight: Tensor, tp_group: dist.ProcessGroup | None = None, vocab_size: int | None = None
) -> Tensor:
    """argmax_v of ``hidden [n, H] @ weight^T`` over the whole vocabulary when ``weight`` is this TP
    rank's contiguous shard [V/tp, H] (rank r holds rows r*V/tp ...); the lowest index among ties,
    as ``torch.argmax``; columns >= ``vocab_size`` (Megatron's padding) never win. Returns [n] int64."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    v_local = weight.shape[0]
    start = rank * v_local
    valid = v_local if vocab_size is None else max(0, min(v_local, vocab_size - start))
    out = []
    for lo in range(0, hidden.shape[0], _ARGMAX_CHUNK):
        logits = hidden[lo : lo + _ARGMAX_CHUNK].float() @ weight.float().t()
        if valid < v_local:
            logits[:, valid:] = -torch.inf
        best, idx = logits.max(dim=-1)
        idx = idx + start
        if tp > 1:
            top = best.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
            idx = torch.where(best == top, idx, torch.full_like(idx, torch.iinfo(torch.int64).max))
            dist.all_reduce(idx, op=dist.ReduceOp.MIN, group=tp_group)
        out.append(idx)
    return torch.cat(out) if out else hidden.new_zeros(0, dtype=torch.long)


@torch.no_grad()
def draft_acceptance(
    drafts: DraftStates,
    labels: Tensor,
    loss_mask: Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    vocab_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(accepted, counted): over the counted positions of MTP layer 1 (``drafts.states[0]`` [b, s, H]),
    how many have the draft's top-1 proposal equal to the token the engine emitted (module docstring),
    float64 scalars. Every TP rank calls it."""
    first = drafts.states[0]
    targets, mask = draft_targets(labels, loss_mask, 1, drafts.packed_seq_params)
    b, s, h = first.shape
    proposal = vocab_parallel_argmax(first.reshape(b * s, h), drafts.weight, tp_group, vocab_size).view(b, s)
    hit = (proposal == targets).double() * mask.double()
    return hit.sum(), mask.double().sum()
