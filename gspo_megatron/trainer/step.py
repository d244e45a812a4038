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

Routing replay (``rollout.routing_replay``, ``trainer.route_replay``): the Samples' routes travel with
their tokens into every micro-batch (``routed_experts`` [b, s, L, K]); the old-policy forward runs in
phase "old", the training forwards in phase "policy"; ``rollout/route_agreement`` is the share of
(token, layer) top-k sets where the trainer's own routing (before replay, old-policy forward) equals
the engine's, over every rank's routers (r3 only); ``rollout/indexer_agreement`` the same for the DSA
indexer's key selections. The KL reference model (``gspo.kl_coef`` > 0)
replays the same routes as the old-policy forward (r3: the engine's; r2: the old forward's record),
so that its KL term compares the two policies on one routing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from gspo_megatron.config import Config, values_for
from gspo_megatron.losses.megatron_loss import make_megatron_loss_func
from gspo_megatron.losses.policy_loss import PolicyLossConfig
from gspo_megatron.runtime.distributed import device
from gspo_megatron.sample import Sample
from gspo_megatron.trainer.behaviour_policy import behaviour_versions
from gspo_megatron.trainer.micro_batches import (
    collate,
    compute_logprobs,
    run_schedule,
    sequence_multiple,
    split_for_context_parallel,
    to_device,
)
from gspo_megatron.trainer.optimizer import optimizer_step, zero_grads
from gspo_megatron.trainer.packing import collate_packed, plan_micro_batches
from gspo_megatron.trainer.route_replay import replay_phase, route_replay_for

_MEAN_KEYS = (
    "ratio_mean",
    "approx_kl_old",
    "clip_fraction",
    "entropy",
    "kl_ref",
    "engine_logprob_absdiff",
    "tis_weight_mean",
    "tis_capped_fraction",
)


@dataclass
class StepResult:
    """The training half of one step, identical on every rank.

    ``metrics``: what metrics.jsonl records (``loss/*``, ``gspo/*``, ``train/*``, ``perf/*`` ...);
    ``nonfinite``: at least one mini-batch's update was skipped (non-finite loss or gradient norm),
    which the trainer counts towards ``optimizer.max_bad_steps``."""

    metrics: dict[str, float]
    nonfinite: bool


def loss_config(cfg: Config) -> PolicyLossConfig:
    """The loss's options from ``gspo.*`` by name (``aggregation`` is ``gspo.loss_agg``)."""
    return PolicyLossConfig(**values_for(PolicyLossConfig, cfg.gspo, renamed={"aggregation": "loss_agg"}))


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
            b["num_computed_tokens"] = int(b["tokens"].numel())  # the whole row, before any CP split
        if cp_group is not None:
            micro = [split_for_context_parallel(b, cp_group) for b in micro]
        out.append(micro)
    return out


def _attach_logprobs(model, batches, key, temperature, fused: bool = True) -> None:
    """batch[key] = the model's log-probs of the labels (last stage; zeros elsewhere, unused)."""
    out = compute_logprobs(model, batches, temperature=temperature, fused_logprobs=fused)
    for i, b in enumerate(batches):
        b[key] = out[i]["logprobs"].float() if out is not None else torch.zeros_like(b["loss_mask"])


def train_on_batch(
    cfg: Config, ddp, optimizer, scheduler, records: list[Sample], pad_id: int, ref_model=None, behaviour=None
) -> StepResult:
    """Every rank: recompute old log-probs, then ``gspo.mini_batches`` optimizer steps. Returns the
    step's metrics and whether an update was skipped (:class:`StepResult`), identical on every rank.

    behaviour: off-policy runs (rollout.max_staleness >= 1), a ``behaviour_policy.WeightHistory``:
    the old log-probs are then the trainer's with the weights that generated each token (records
    carry ``behaviour_version``), and the history learns that the weights moved on."""
    from megatron.core import parallel_state as ps

    t0 = time.perf_counter()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    cp_group = ps.get_context_parallel_group() if cp > 1 else None
    minis = split_batch(cfg, records, dp, dp_rank, pad_id, multiple=row_multiple(cfg, tp, cp), cp_group=cp_group)
    flat = [b for mb in minis for b in mb]
    temp = cfg.rollout.temperature
    fused = cfg.model.fused_logprobs
    replay = route_replay_for(ddp, cfg.rollout.routing_replay)  # None: off
    if replay is not None:
        if replay.mode == "r3":
            missing = [i for i, r in enumerate(records) if r.routed_experts is None]
            if missing:
                raise ValueError(
                    f"rollout.routing_replay=r3: sample {missing[0]} (of {len(records)}) has no "
                    "routed_experts; the engines must be asked for them (rollout.engine=sglang)"
                )
            missing = [i for i, r in enumerate(records) if replay.indexers and r.indexer_topk is None]
            if missing:  # DSA: the indexer's selection is replayed too (trainer/route_replay.py)
                raise ValueError(
                    f"rollout.routing_replay=r3: sample {missing[0]} (of {len(records)}) has no "
                    "indexer_topk; a DSA model's engines must return it (return_indexer_topk)"
                )
        replay.phase = "old"  # r3: replay the engine's routes; r2: record the trainer's own
    if behaviour is not None and any(int(v) != behaviour.current for r in records for v in behaviour_versions(r)):
        behaviour.attach_old_logprobs(ddp, flat, records, temp, fused)
    else:
        _attach_logprobs(ddp, flat, "old_logprobs", temp, fused)
    if replay is not None:
        replay.phase = "policy"  # the training forwards replay (r3: the engine's routes, r2: the recorded ones)
    if ref_model is not None:  # the old forward's routes (r3: the engine's; r2: the record of the old forward)
        with replay_phase(ref_model, cfg.rollout.routing_replay, "policy"):
            _attach_logprobs(ref_model, flat, "ref_logprobs", temp, fused)
    # the engine gap is summed over every CP rank's tokens; the loss metrics are exact over CP
    gap_reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    reporter = gap_reporter and ps.get_context_parallel_rank() == 0
    # [engine gap sum, its token count, computed tokens, real tokens, agreeing and compared (token,
    # layer) routes of this rank's routers (disjoint over ranks: summed), agreeing and compared
    # (token, layer) DSA indexer selections (r3)]; one collective for all
    gap = torch.zeros(8, dtype=torch.float64, device=device())  # collectives need NCCL's device
    if replay is not None:
        gap[4], gap[5] = replay.take_agreement()
        gap[6], gap[7] = replay.take_indexer_agreement()
    if gap_reporter:
        for b in flat:
            gap[0] += ((b["old_logprobs"] - b["engine_logprobs"]).abs() * b["loss_mask"]).sum().double()
            gap[1] += b["loss_mask"].sum().double()
    if reporter:  # one rank per DP replica counts its rows (whole rows, before the CP split)
        gap[2] += float(sum(b["num_computed_tokens"] for b in flat))
        gap[3] += float(sum(b["num_real_tokens"] for b in flat))
    t_old = time.perf_counter() - t0

    lcfg = loss_config(cfg)
    tp_group = ps.get_tensor_model_parallel_group()
    mb_metrics, applied, grad_norms = [], [], []
    for micro in minis:
        zero_grads(ddp, optimizer)
        out = run_schedule(
            ddp,
            micro,
            partial(
                make_megatron_loss_func,
                cfg=lcfg,
                tp_group=tp_group,
                cp_group=cp_group,
                num_microbatches=len(micro),
                data_parallel_size=dp,
                temperature=temp,
                compute_entropy=True,
                check_finite=False,
            ),
            forward_only=False,
            fused_logprobs=fused,
        )
        ok, gn = optimizer_step(optimizer, scheduler)
        applied.append(ok)
        grad_norms.append(gn)
        mb_metrics.append(out if reporter else [])
    metrics = _reduce_metrics(mb_metrics, len(minis))
    torch_gap = gap.clone()
    dist.all_reduce(torch_gap)
    metrics.update(
        {
            "rollout/logprob_abs_diff": float(torch_gap[0] / max(float(torch_gap[1]), 1.0)),
            # fraction of the tokens the model computes (per pass) that are padding
            "perf/padding_frac": float(1.0 - torch_gap[3] / max(float(torch_gap[2]), 1.0)),
            **({"rollout/route_agreement": float(torch_gap[4] / torch_gap[5])} if torch_gap[5] > 0 else {}),
            **({"rollout/indexer_agreement": float(torch_gap[6] / torch_gap[7])} if torch_gap[7] > 0 else {}),
            "train/skipped_updates": float(sum(not a for a in applied)),
            "train/grad_norm": _mean_finite(grad_norms),
            "train/lr": float(optimizer.param_groups[0]["lr"]),
            "perf/old_logprob_s": t_old,
            "perf/train_s": time.perf_counter() - t0 - t_old,
        }
    )
    if replay is not None:
        replay.phase = None
    if behaviour is not None:
        behaviour.trained()
    return StepResult(metrics=metrics, nonfinite=not all(applied))


def _mean_finite(values) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(sum(vals) / len(vals)) if vals else float("nan")


def _reduce_metrics(per_minibatch: list[list[dict]], num_minibatches: int) -> dict:
    """Global step metrics from the loss functions' micro-batch metrics (reported on the last stage,
    TP rank 0 only): loss summed per mini-batch then averaged over mini-batches; sequence-weighted
    means; min / max ratio over everything."""
    keys = list(_MEAN_KEYS)
    dev = device()  # collectives need NCCL's device on GPU
    sums = torch.zeros(len(keys) + 3, dtype=torch.float64, device=dev)
    seen = torch.zeros(len(keys), dtype=torch.float64, device=dev)  # which metrics the loss reported at all
    lo = torch.tensor([math.inf], dtype=torch.float64, device=dev)
    hi = torch.tensor([-math.inf], dtype=torch.float64, device=dev)
    for micro in per_minibatch:
        for m in micro:
            w = m.get("num_seqs", 0.0)
            for i, k in enumerate(keys):
                if k in m:
                    sums[i] += w * m[k]
                    seen[i] = 1.0
            sums[len(keys)] += w
            sums[len(keys) + 1] += m["loss"]
            sums[len(keys) + 2] += m.get("pg_loss", 0.0)
            if w > 0:
                lo[0] = min(lo[0].item(), m["ratio_min"])
                hi[0] = max(hi[0].item(), m["ratio_max"])
    dist.all_reduce(sums)
    dist.all_reduce(seen)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    w = max(sums[len(keys)].item(), 1.0)
    names = {
        "ratio_mean": "gspo/ratio_mean",
        "clip_fraction": "gspo/clip_frac",
        "approx_kl_old": "gspo/approx_kl",
        "entropy": "policy/entropy",
        "kl_ref": "loss/kl_ref",
        "engine_logprob_absdiff": "rollout/engine_gap_seq",
        "tis_weight_mean": "tis/weight_mean",
        "tis_capped_fraction": "tis/capped_frac",
    }
    out = {names[k]: sums[i].item() / w for i, k in enumerate(keys) if seen[i] > 0}
    out["loss/total"] = sums[len(keys) + 1].item() / num_minibatches
    out["loss/policy"] = sums[len(keys) + 2].item() / num_minibatches
    out["gspo/ratio_min"] = lo.item() if math.isfinite(lo.item()) else 1.0
    out["gspo/ratio_max"] = hi.item() if math.isfinite(hi.item()) else 1.0
    out["train/num_seqs"] = sums[len(keys)].item()
    return out
