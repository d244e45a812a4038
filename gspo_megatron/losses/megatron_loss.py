"""The loss function Megatron-Core's forward-backward schedule calls on the last pipeline stage.

The trainer's ``forward_step_func(data_iterator, model)`` runs the model on one micro-batch and
returns ``(logits, make_megatron_loss_func(batch, cfg, ...))``. ``logits`` is GPTModel's output with
``labels=None``: [b, s, V/tp] (vocab-parallel, already transposed from [s, b, V/tp]).
With the fused output layer (``model.fused_logprobs``, :func:`gspo_megatron.models.lm_head.lm_forward`)
the forward step returns the hidden states [b, s, H] instead and binds the output weight shard
[V/tp, H] as the loss function's ``output_weight`` keyword: the log-probs then come from
:func:`~gspo_megatron.losses.fused_logprobs.fused_vocab_parallel_logprobs` and no logits exist.

Micro-batch dict (tensors on the model's device; for context parallel, the [b, s] tensors are this
CP rank's slice of the tokens, cut exactly like the model's input):

    labels          [b, s] long   target id of each position (the next token); anything where loss_mask is 0
    loss_mask       [b, s]        1 on response tokens, 0 on prompt / padding
    old_logprobs    [b, s] float  the trainer's log-probs before the update (same temperature)
    seq_index       [b, s] long   micro-batch sequence of each token: the row for padded batches,
                                  the segment of ``cu_seqlens`` for packed THD rows
                                  (:func:`~gspo_megatron.losses.seq_index_from_cu_seqlens`)
    advantages      [S] float (per sequence) or [b, s] float (per token: gspo_token / grpo)
    normalizer      float / 0-d tensor: the number of sequences with >= 1 response token in the
                    whole global batch (all micro-batches, all DP ranks) -- or, for
                    aggregation="token-mean", the number of response tokens there
    num_seqs        int, S; needed only with per-token advantages (else advantages.numel())
    ref_logprobs    [b, s] float, optional (KL to the reference policy)
    engine_logprobs [b, s] float, optional (engine/trainer gap metric; TIS when cfg.tis_cap is set)
    teacher_logprobs [b, s] float, with cfg.distill_coef != 0: a distillation teacher's log-probs of
                    the sampled tokens (``losses/distill_loss.py``)
    draft_normalizer float, with ``mtp_coef`` > 0: the response tokens of the whole mini-batch

MTP draft (``gspo.mtp_loss_coef``, ``losses/mtp_loss.py``): when the forward step asked the model for
its MTP layers' states, it binds them as ``drafts`` (a ``losses.mtp_loss.DraftStates``: one [b, s, H] per
MTP layer, the detached output weight shard, the micro-batch's packed-sequence parameters); the loss
then adds ``mtp_coef / M * sum(cross entropy) / draft_normalizer`` (scaled like the policy loss), whose
gradient reaches the MTP layers only, and reports it as ``metrics["mtp_loss"]`` (without the coefficient) and inside ``metrics["loss"]``.

Scaling convention (megatron-core 0.16.1, read from pipeline_parallel/schedules.py and
distributed/distributed_data_parallel.py). The trainer must leave ``calculate_per_token_loss=False``
(the default; :func:`check_megatron_config` enforces it) and may use either value of DDP's
``average_in_collective``. Then:

- the loss function returns a 2-tuple ``(loss, metrics)``; the schedule multiplies ``loss`` by
  ``cp_size / num_microbatches`` before backward;
- DDP scales gradients by ``1 / (dp * cp)`` around the sum over the data-parallel-with-CP group
  (pre-scaling, or an AVG collective);

so the net factor on each returned loss is ``1 / (num_microbatches * dp)``. We return
``policy_loss * num_microbatches * dp`` where ``policy_loss`` is this rank's share of the
global-batch loss (it is divided by the global ``normalizer``; CP ranks hold shares that add up).
Hence the accumulated, reduced gradient is exactly the gradient of the global-batch loss, for any
number of micro-batches, DP and CP sizes. ``metrics["loss"]`` is the unscaled share; summing it over
micro-batches and DP (and CP) ranks gives the global-batch loss.
MoE auxiliary losses keep Megatron's default scaling for this mode.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_megatron.losses.distill_loss import distill_loss
from gspo_megatron.losses.fused_logprobs import fused_vocab_parallel_logprobs
from gspo_megatron.losses.mtp_loss import DraftStates, draft_acceptance, mtp_loss_sum
from gspo_megatron.losses.policy_loss import PolicyLossConfig, policy_loss_flat
from gspo_megatron.losses.vocab_parallel import vocab_parallel_logprobs

REQUIRED_KEYS = ("labels", "loss_mask", "old_logprobs", "seq_index", "advantages", "normalizer")
# the [b, s] tensors of a micro-batch that the loss shape-checks against the model output
SHAPE_CHECKED_KEYS = (
    "labels",
    "loss_mask",
    "old_logprobs",
    "seq_index",
    "ref_logprobs",
    "engine_logprobs",
    "teacher_logprobs",
)


def check_megatron_config(config: Any) -> None:
    """Raise unless the Megatron model config matches the scaling convention of this module."""
    if getattr(config, "calculate_per_token_loss", False):
        raise ValueError(
            "calculate_per_token_loss must be False: the GSPO loss function divides by the global-batch "
            "normalizer itself and returns a 2-tuple (see gspo_megatron.losses.megatron_loss)"
        )


def _check_batch(batch: dict[str, Any], logits: Tensor) -> tuple[int, int]:
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    if missing:
        raise KeyError(f"micro-batch is missing {missing} (needed by the GSPO loss function)")
    if logits.dim() != 3:
        raise ValueError(
            f"output_tensor must be logits [b, s, V/tp] or hidden states [b, s, H], got shape {tuple(logits.shape)}"
        )
    b, s = logits.shape[:2]
    for k in SHAPE_CHECKED_KEYS:
        if batch.get(k) is not None and tuple(batch[k].shape) != (b, s):
            raise ValueError(
                f"batch[{k!r}] must be [b, s] = [{b}, {s}] like the model output, got {tuple(batch[k].shape)}"
            )
    return b, s


def token_logprobs(output_tensor: Tensor, labels: Tensor, output_weight: Tensor | None, **kwargs):
    """(logprobs, entropy) [b, s] of ``labels`` from the logits [b, s, V/tp] (``output_weight`` None)
    or from the hidden states [b, s, H] and the output weight shard [V/tp, H] (fused)."""
    if output_weight is None:
        return vocab_parallel_logprobs(output_tensor, labels, **kwargs)
    return fused_vocab_parallel_logprobs(output_tensor, output_weight, labels, **kwargs)


def make_megatron_loss_func(
    batch: dict[str, Any],
    cfg: PolicyLossConfig,
    *,
    tp_group: dist.ProcessGroup | None,
    cp_group: dist.ProcessGroup | None,
    num_microbatches: int,
    data_parallel_size: int,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    compute_entropy: bool = True,
    vocab_size: int | None = None,
    check_finite: bool = True,
    mtp_coef: float = 0.0,
) -> Callable[[Tensor], tuple[Tensor, dict[str, float]]]:
    """The ``loss_func`` for one micro-batch (see the module docstring for keys and scaling).

    Args:
        tp_group / cp_group: Megatron's tensor / context-parallel groups (None: size 1).
        num_microbatches: micro-batches per optimizer step on this DP rank (what the schedule gets).
        data_parallel_size: DP size *without* CP (Megatron's ``get_data_parallel_world_size()``).
        temperature: the rollout sampling temperature (logits are divided by it).
        compute_entropy: compute the per-token entropy (metric "entropy"); forced on when
            ``cfg.entropy_coef != 0``.
        check_finite: raise on non-finite inputs (naming them). The trainer passes False: a
            non-finite loss then yields a non-finite gradient norm and the update is skipped.
        mtp_coef: ``gspo.mtp_loss_coef``, applied when the forward step binds ``drafts`` (module docstring).
        vocab_size: the tokenizer/HF vocab size when Megatron padded the output layer (padded
            columns are left out of the softmax, as in the rollout engine).
    The returned function maps logits [b, s, V/tp] (or hidden states [b, s, H] with the keyword
    ``output_weight`` [V/tp, H]: the fused path) to ``(scaled loss, metrics)``; it runs TP and CP
    collectives, so every rank of those groups calls it.
    """
    if num_microbatches < 1 or data_parallel_size < 1:
        raise ValueError(
            f"num_microbatches and data_parallel_size must be >= 1, got {num_microbatches}, {data_parallel_size}"
        )
    with_entropy = compute_entropy or cfg.entropy_coef != 0
    use_topk = cfg.distill_coef != 0 and distill_loss(cfg.distill_loss).topk
    if use_topk and "teacher_topk_ids" not in batch:
        raise KeyError(
            f"distill.loss={cfg.distill_loss!r} needs the teacher's top-k in the micro-batch (distill.topk > 0)"
        )
    scale = float(num_microbatches * data_parallel_size)

    def loss_func(
        output_tensor: Tensor,
        output_weight: Tensor | None = None,
        drafts: DraftStates | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        b, s = _check_batch(batch, output_tensor)
        logprobs, entropy = token_logprobs(
            output_tensor,
            batch["labels"],
            output_weight,
            tp_group=tp_group,
            temperature=temperature,
            chunk_size=chunk_size,
            with_entropy=with_entropy,
            vocab_size=vocab_size,
        )
        adv = batch["advantages"]
        token_adv = adv.dim() == 2
        if token_adv and tuple(adv.shape) != (b, s):
            raise ValueError(f"batch['advantages'] per token must be [b, s] = [{b}, {s}], got {tuple(adv.shape)}")
        if token_adv and "num_seqs" not in batch:
            raise KeyError("micro-batch needs 'num_seqs' when 'advantages' is per token [b, s]")
        num_seqs = int(batch["num_seqs"]) if "num_seqs" in batch else adv.numel()

        def student_topk(out: Tensor, weight: Tensor | None) -> tuple[Tensor, Tensor]:
            """(student, teacher) log-probs [N, K] of the teacher's top-k tokens: one vocab-parallel
            log-prob pass over the same logits (or fused head) scoring all K ids (K targets per
            token: the softmax statistics computed once), exact across TP ranks. A teacher token
            outside the student's vocabulary (``vocab_size``: the padded rows) gets teacher log-prob
            -1e4 (weight 0 in the renormalized top-k) and is scored as token 0."""
            ids, teacher = batch["teacher_topk_ids"], batch["teacher_topk_logprobs"]
            if vocab_size is not None:
                outside = ids >= vocab_size
                ids = torch.where(outside, torch.zeros_like(ids), ids)
                teacher = torch.where(outside, torch.full_like(teacher, -1e4), teacher)
            student, _ = token_logprobs(
                out,
                ids,
                weight,
                tp_group=tp_group,
                temperature=temperature,
                chunk_size=chunk_size,
                with_entropy=False,
                vocab_size=vocab_size,
            )
            return student.reshape(-1, ids.shape[-1]), teacher.reshape(-1, ids.shape[-1])

        def flat(key: str) -> Tensor:  # one of REQUIRED_KEYS (_check_batch)
            return batch[key].reshape(-1)

        def flat_optional(key: str) -> Tensor | None:
            x = batch.get(key)
            return None if x is None else x.reshape(-1)

        loss, metrics = policy_loss_flat(
            logprobs.reshape(-1),
            flat("old_logprobs"),
            adv.reshape(-1),
            flat("loss_mask"),
            flat("seq_index"),
            num_seqs,
            cfg,
            ref_logprobs=flat_optional("ref_logprobs"),
            entropy=None if entropy is None else entropy.reshape(-1),
            engine_logprobs=flat_optional("engine_logprobs"),
            teacher_logprobs=flat_optional("teacher_logprobs") if cfg.distill_coef != 0 else None,
            topk_logprobs=student_topk(output_tensor, output_weight) if use_topk else None,
            normalizer=batch["normalizer"],
            cp_group=cp_group,
            token_advantages=token_adv,
            check_finite=check_finite,
        )
        if drafts is not None and mtp_coef:
            if "draft_normalizer" not in batch:
                raise KeyError("the MTP loss needs batch['draft_normalizer'] (trainer.step.split_batch)")
            ce_sum, _count = mtp_loss_sum(
                drafts,
                batch["labels"],
                batch["loss_mask"],
                tp_group=tp_group,
                chunk_size=chunk_size,
                vocab_size=vocab_size,
            )
            mtp = ce_sum / (len(drafts.states) * float(batch["draft_normalizer"]))
            loss = loss + mtp_coef * mtp
            metrics["mtp_loss"] = float(mtp.detach())
            metrics["loss"] = float(metrics["loss"]) + mtp_coef * metrics["mtp_loss"]
        return loss * scale, metrics

    return loss_func


def make_megatron_logprob_func(
    batch: dict[str, Any],
    *,
    tp_group: dist.ProcessGroup | None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    vocab_size: int | None = None,
) -> Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]]:
    """A forward-only ``loss_func`` that collects per-token log-probs (old / reference policy).

    Run the schedule with ``forward_only=True``; each micro-batch appends
    ``{"logprobs": [b, s], "entropy": [b, s] (if asked)}`` (detached fp32) to the returned list; when the
    forward step binds the MTP layers' ``drafts`` (``DraftStates``), also ``draft_accept`` /
    ``draft_positions`` (float64 scalars: :func:`~gspo_megatron.losses.mtp_loss.draft_acceptance`).
    Uses only ``batch["labels"]`` [b, s]. Every TP rank calls it. Takes logits [b, s, V/tp], or hidden
    states [b, s, H] with the keyword ``output_weight`` [V/tp, H] (fused path).
    """

    def logprob_func(
        output_tensor: Tensor,
        output_weight: Tensor | None = None,
        drafts: DraftStates | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        if "labels" not in batch:
            raise KeyError("micro-batch is missing 'labels' (needed to compute log-probs)")
        with torch.no_grad():
            logprobs, entropy = token_logprobs(
                output_tensor,
                batch["labels"],
                output_weight,
                tp_group=tp_group,
                temperature=temperature,
                chunk_size=chunk_size,
                with_entropy=with_entropy,
                vocab_size=vocab_size,
            )
        out = {"logprobs": logprobs}
        if entropy is not None:
            out["entropy"] = entropy
        if drafts is not None:  # the MTP draft's first-token acceptance (losses/mtp_loss.py)
            out["draft_accept"], out["draft_positions"] = draft_acceptance(
                drafts,
                batch["labels"],
                batch["loss_mask"],
                tp_group=tp_group,
                vocab_size=vocab_size,
            )
        return output_tensor.new_zeros((), dtype=torch.float32), out

    return logprob_func
