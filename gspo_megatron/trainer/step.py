"""The training half of a step, on every rank: split the rollout batch, recompute old log-probs,
then one optimizer step per mini-batch through Megatron's forward-backward schedule.

Batch layout: the N sequences are cut into ``gspo.mini_batches`` contiguous mini-batches. Padded
(``parallel.max_tokens_per_micro_batch`` 0): in each, data-parallel rank r takes sequences r, r+dp,
...; those are cut into right-padded micro-batches of ``parallel.micro_batch_size``. Packed (budget
> 0): sequences go to DP ranks balancing token counts and are packed into micro-batches of at most
the budget (``gspo_megatron.trainer.packing``), every rank running the same number of micro-batches. Either
way each mini-batch's loss is normalized by its global sequence count (token count for token-mean),
so the reduced gradient is exactly that of the mini-batch mean whatever the grouping. Row lengths
(packed rows' totals) are rounded up to ``row_multiple``: the TP / CP splits, and with ``model.fp8``
Transformer Engine's FP8 GEMM alignment on every rank (``trainer.micro_batches.sequence_multiple``).

The step is a fixed sequence of passes whose components (routing replay, behaviour policy, KL
reference model) are composed when it is built (``trainer.step_passes``): the old log-probs inside
the routing replay's recording, the reference's log-probs replaying those routes, then the training
forwards replaying them too. Routing replay (``rollout.routing_replay``, ``trainer.route_replay``):
the Samples' routes travel with their tokens into every micro-batch (``routed_experts`` [b, s, L,
K]); ``rollout/route_agreement`` is the share of (token, layer) top-k sets where the trainer's own
routing (before replay, old-policy forward) equals the engine's, over every rank's routers (r3 only);
``rollout/indexer_agreement`` the same for the DSA indexer's key selections. The KL reference model
(``gspo.kl_coef`` > 0) replays the same routes as the old-policy forward (r3: the engine's; r2: the
old forward's record), so that its KL term compares the two policies on one routing. Metrics are
reduced by name (``trainer.step_metrics``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch.distributed as dist

from gspo_megatron.config import Config, values_for
from gspo_megatron.losses.megatron_loss import make_megatron_loss_func
from gspo_megatron.losses.policy_loss import PolicyLossConfig
from gspo_megatron.sample import Sample
from gspo_megatron.trainer.micro_batches import (
    collate,
    run_schedule,
    sequence_multiple,
    split_for_context_parallel,
    to_device,
)
from gspo_megatron.trainer.optimizer import optimizer_step, zero_grads
from gspo_megatron.trainer.packing import collate_packed, plan_micro_batches
from gspo_megatron.trainer.step_metrics import mean_finite, old_pass_sums, reduce_loss_metrics, step_sum_metrics
from gspo_megatron.trainer.step_passes import StepPasses
from gspo_megatron.trainer.step_passes import attach_logprobs as _attach_logprobs  # noqa: F401 (tests, bench)


@dataclass
class StepResult:
    """The training half of one step, identical on every rank.

    ``metrics``: what metrics.jsonl records (``loss/*``, ``gspo/*``, ``train/*``, ``perf/*`` ...);
    ``nonfinite``: at least one mini-batch's update was skipped (non-finite loss or gradient norm),
    which the trainer counts towards ``optimizer.max_bad_steps``."""

    metrics: dict[str, float]
    nonfinite: bool


def loss_config(cfg: Config) -> PolicyLossConfig:
    """The loss's options from ``gspo.*`` and ``distill.*`` by name (``aggregation`` is
    ``gspo.loss_agg``, ``distill_coef`` / ``distill_loss`` are ``distill.coef`` / ``distill.loss``)."""
    loss_keys = {"aggregation": "loss_agg", "distill_coef": "coef", "distill_loss": "loss"}
    return PolicyLossConfig(**values_for(PolicyLossConfig, cfg.gspo, cfg.distill, renamed=loss_keys))


def row_multiple(cfg: Config, tp: int, cp: int) -> int:
    """What this run's rows (packed rows) must be padded to a multiple of: ``trainer.micro_batches.sequence_multiple``
    with ``model.fp8`` / ``model.fp8_recipe`` and sequence parallelism as ``models.build`` resolves
    ``parallel.sequence_parallel`` (None: on when tp > 1)."""
    return sequence_multiple(
        tp, cp, fp8=cfg.model.fp8, sp=cfg.parallel.sequence_parallel, fp8_recipe=cfg.model.fp8_recipe
    )


def split_batch(
    cfg: Config,
    records: list[Sample],
    dp: int,
    dp_rank: int,
    pad_id: int,
    multiple: int | None = None,
    cp_group=None,
    tp: int | None = None,
):
    """Mini-batches (lists of this rank's micro-batch dicts, each carrying its mini-batch's global
    normalizer). ``multiple``: what a row's length must divide; None: ``row_multiple(cfg, tp, cp)``
    (``tp`` None: Megatron's tensor-parallel size), which takes ``model.fp8`` into account.
    With context parallelism (``cp_group``) every per-token tensor is this CP rank's slice.
    Every rank of a DP replica gets the same micro-batches; ``seq_ids`` index ``records``."""
    M = cfg.gspo.mini_batches
    n = len(records)
    token_mean = cfg.gspo.loss_agg == "token-mean"
    budget = cfg.parallel.max_tokens_per_micro_batch or 0
    cp = dist.get_world_size(cp_group) if cp_group is not None else 1
    if multiple is None:
        if tp is None:
            from megatron.core import parallel_state as ps

            tp = ps.get_tensor_model_parallel_world_size()
        multiple = row_multiple(cfg, tp, cp)
    out = []
    for m in range(M):
        lo = m * n // M
        mb = records[lo : (m + 1) * n // M]
        norm = sum(r.trained_tokens if token_mean else int(r.trained_tokens > 0) for r in mb)
        tokens = sum(r.trained_tokens for r in mb)  # the MTP loss's denominator (losses/megatron_loss.py)
        if budget:
            plan = plan_micro_batches([r.length for r in mb], dp, budget, seg_multiple=2 * cp if cp > 1 else 1)[dp_rank]
            micro = [
                collate_packed(
                    [mb[i] for i in idx],
                    pad_id=pad_id,
                    seg_multiple=2 * cp if cp > 1 else 1,
                    row_multiple=multiple,
                    seq_ids=[lo + i for i in idx],
                )
                for idx in plan
            ]
        else:
            mine = [i for i in range(len(mb)) if i % dp == dp_rank]
            size = cfg.parallel.micro_batch_size
            micro = [
                collate(
                    [mb[i] for i in mine[j : j + size]],
                    pad_id=pad_id,
                    multiple=multiple,
                    seq_ids=[lo + i for i in mine[j : j + size]],
                )
                for j in range(0, len(mine), size)
            ]
        micro = [to_device(b) for b in micro]
        for b in micro:
            b["normalizer"] = float(max(norm, 1))
            b["draft_normalizer"] = float(max(tokens, 1))
            b["num_computed_tokens"] = int(b["tokens"].numel())  # the whole row, before any CP split
        if cp_group is not None:
            micro = [split_for_context_parallel(b, cp_group) for b in micro]
        out.append(micro)
    return out


def train_on_batch(
    cfg: Config, ddp, optimizer, scheduler, records: list[Sample], pad_id: int, ref_model=None, behaviour=None
) -> StepResult:
    """Every rank: recompute old log-probs, then ``gspo.mini_batches`` optimizer steps. Returns the
    step's metrics and whether an update was skipped (:class:`StepResult`), identical on every rank.

    ref_model: the KL reference model (``gspo.kl_coef`` > 0), else None. behaviour: off-policy runs
    (rollout.max_staleness >= 1), a ``behaviour_policy.WeightHistory``: the old log-probs are then
    the trainer's with the weights that generated each token (records carry ``behaviour_version``),
    and the history learns that the weights moved on. Passes: ``trainer.step_passes``."""
    from megatron.core import parallel_state as ps

    t0 = time.perf_counter()
    passes = StepPasses.build(
        ddp,
        routing_replay=cfg.rollout.routing_replay,
        temperature=cfg.rollout.temperature,
        fused_logprobs=cfg.model.fused_logprobs,
        ref_model=ref_model,
        behaviour=behaviour,
        drafts=cfg.mtp_in_model,
    )
    passes.check(records)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    cp_group = ps.get_context_parallel_group() if cp > 1 else None
    minis = split_batch(cfg, records, dp, dp_rank, pad_id, multiple=row_multiple(cfg, tp, cp), cp_group=cp_group)
    flat = [b for mb in minis for b in mb]
    passes.logprobs(ddp, flat, records)  # old log-probs (recording the routes), then the reference's
    # the engine gap is summed over every CP rank's tokens; the loss metrics are exact over CP
    gap_reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    reporter = gap_reporter and ps.get_context_parallel_rank() == 0
    sums = old_pass_sums(flat, passes.replay.take_counts(), gap_reporter=gap_reporter, reporter=reporter)
    t_old = time.perf_counter() - t0

    loss_func = partial(
        make_megatron_loss_func,
        cfg=loss_config(cfg),
        tp_group=ps.get_tensor_model_parallel_group(),
        cp_group=cp_group,
        data_parallel_size=dp,
        temperature=cfg.rollout.temperature,
        compute_entropy=True,
        check_finite=False,
        mtp_coef=cfg.gspo.mtp_loss_coef,
    )
    with passes.training():  # the training forwards replay the recorded routes
        steps = [_train_mini_batch(ddp, optimizer, scheduler, micro, loss_func, cfg) for micro in minis]
    metrics = reduce_loss_metrics(
        [out if reporter else [] for out, _, _ in steps], len(minis), mtp_loss=cfg.gspo.mtp_loss_coef > 0
    )
    metrics.update(step_sum_metrics(sums.all_reduce()))
    applied = [ok for _, ok, _ in steps]
    metrics.update(
        {
            "train/skipped_updates": float(sum(not a for a in applied)),
            "train/grad_norm": mean_finite([gn for _, _, gn in steps]),
            "train/lr": float(optimizer.param_groups[0]["lr"]),
            "perf/old_logprob_s": t_old,
            "perf/train_s": time.perf_counter() - t0 - t_old,
        }
    )
    passes.trained()
    return StepResult(metrics=metrics, nonfinite=not all(applied))


def _train_mini_batch(ddp, optimizer, scheduler, micro: list[dict], loss_func, cfg: Config):
    """One optimizer step on one mini-batch's micro-batches (this rank's) through Megatron's
    forward-backward schedule; ``loss_func``: ``make_megatron_loss_func`` with every option but the
    micro-batch count. Returns (the loss function's metrics per micro-batch, whether the update was
    applied, the gradient norm or None)."""
    zero_grads(ddp, optimizer)
    out = run_schedule(
        ddp,
        micro,
        partial(loss_func, num_microbatches=len(micro)),
        forward_only=False,
        fused_logprobs=cfg.model.fused_logprobs,
        with_drafts=cfg.gspo.mtp_loss_coef > 0,  # the MTP layers run (and learn) only when their loss is on
    )
    ok, gn = optimizer_step(optimizer, scheduler)
    return out, ok, gn
