"""The training step's metrics by name (``trainer.step.train_on_batch``).

Two kinds of numbers leave a rank:

- the step's sums (:data:`STEP_SUMS`), counted once per step around the old-log-prob pass and
  summed over every rank in one all-reduce (:class:`NamedSums`, one float64 tensor):
  engine gap sum_t |old_t - engine_t| and its token count (last stage, TP rank 0, every CP rank),
  computed and real tokens (whole rows: one rank per DP replica), and the routing replay's agreeing /
  compared (token, layer) counts (r3; disjoint over ranks). :func:`step_sum_metrics` turns them into
  ``rollout/logprob_abs_diff`` = gap / max(tokens, 1), ``perf/padding_frac`` = 1 - real / max(computed,
  1), ``rollout/route_agreement`` = agree / compared and ``rollout/indexer_agreement`` (only where
  something was compared); with MTP layers in the model, the draft's first-token acceptance counts
  (``draft_accept`` / ``draft_positions``, last stage, TP rank 0) give ``spec/draft_accept_rate``;
- the loss function's micro-batch metrics (reported on the last stage, TP rank 0 only),
  :func:`reduce_loss_metrics`: ``loss/total`` and ``loss/policy`` summed per mini-batch then averaged
  over mini-batches; the :data:`LOSS_MEANS` weighted by each micro-batch's ``num_seqs`` (only those the
  loss reported at all); ``gspo/ratio_min`` / ``gspo/ratio_max`` over everything (1.0 when nothing was
  seen); ``train/num_seqs``; with the MTP loss (``mtp_loss``), ``loss/mtp`` (the draft's cross entropy,
  without its coefficient, per mini-batch, averaged).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_megatron.runtime.distributed import device

# The step's sums, in the order of their tensor (trainer.step_passes.RoutingReplayPasses.take_counts
# names the last four).
STEP_SUMS = (
    "engine_gap",  # sum over response tokens of |old_logprobs - engine_logprobs|
    "engine_gap_tokens",  # those tokens
    "computed_tokens",  # tokens the model computes per pass (whole rows, padding included)
    "real_tokens",  # the real (unpadded) ones
    "route_agree",  # r3: (token, layer) top-k sets of the old forward equal to the engine's
    "route_compared",
    "indexer_agree",  # r3, DSA: (token, layer) indexer selections equal to the engine's
    "indexer_compared",
    "draft_accept",  # model.mtp: response positions where the MTP draft's top-1 is the emitted token
    "draft_positions",  # the positions counted (losses/mtp_loss.draft_acceptance)
)

# (the loss function's metric, its name in metrics.jsonl): sequence-weighted means over the step
LOSS_MEANS = (
    ("ratio_mean", "gspo/ratio_mean"),
    ("approx_kl_old", "gspo/approx_kl"),
    ("clip_fraction", "gspo/clip_frac"),
    ("entropy", "policy/entropy"),
    ("kl_ref", "loss/kl_ref"),
    ("engine_logprob_absdiff", "rollout/engine_gap_seq"),
    ("tis_weight_mean", "tis/weight_mean"),
    ("tis_capped_fraction", "tis/capped_frac"),
    ("distill_reverse_kl", "loss/distill_reverse_kl"),  # distill.coef > 0: mean_t old_t - teacher_t
    ("distill_clip_fraction", "distill/clip_frac"),  # reverse_kl: tokens whose distillation term is clipped
)
_MEAN_KEYS = tuple(key for key, _ in LOSS_MEANS)
_LOSS_TOTALS = ("num_seqs", "loss", "pg_loss", "mtp_loss")  # sum of num_seqs weights, losses, policy / MTP losses


class NamedSums:
    """float64 numbers under fixed names, packed in one tensor [len(names)] on ``dev`` (the
    collectives' device) so that one collective reduces them all."""

    def __init__(self, names: tuple[str, ...], dev: torch.device):
        if len(set(names)) != len(names):
            raise ValueError(f"NamedSums: names must be distinct, got {names}")
        self.names = names
        self._slots = {name: i for i, name in enumerate(names)}
        self.values = torch.zeros(len(names), dtype=torch.float64, device=dev)

    def _slot(self, name: str) -> int:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"NamedSums: no slot named {name!r} (slots: {', '.join(self.names)})") from None

    def __getitem__(self, name: str) -> Tensor:
        return self.values[self._slot(name)]

    def __setitem__(self, name: str, value: float | Tensor) -> None:
        self.values[self._slot(name)] = value

    def add(self, name: str, value: float | Tensor) -> None:
        """values[name] += value (in place, float64)."""
        self.values[self._slot(name)] += value

    def all_reduce(self, op=dist.ReduceOp.SUM) -> dict[str, Tensor]:
        """Reduce the tensor over the default group in place (one collective); 0-d views by name."""
        dist.all_reduce(self.values, op=op)
        return dict(zip(self.names, self.values.unbind(0)))


def old_pass_sums(flat: list[dict], counts: dict[str, int], *, gap_reporter: bool, reporter: bool) -> NamedSums:
    """This rank's :data:`STEP_SUMS` after the old-log-prob pass. ``flat``: this rank's micro-batches
    (``old_logprobs``, ``engine_logprobs``, ``loss_mask`` [b, s]; ``num_computed_tokens``,
    ``num_real_tokens``); ``counts``: the routing replay's counts by name; ``gap_reporter``: this
    rank sums the engine gap (last stage, TP rank 0); ``reporter``: it also counts the rows (and CP
    rank 0: one rank per DP replica, whole rows before the CP split)."""
    sums = NamedSums(STEP_SUMS, device())  # collectives need NCCL's device
    for name, value in counts.items():
        sums[name] = value
    if gap_reporter:
        for b in flat:
            sums.add("engine_gap", ((b["old_logprobs"] - b["engine_logprobs"]).abs() * b["loss_mask"]).sum().double())
            sums.add("engine_gap_tokens", b["loss_mask"].sum().double())
            if "draft_positions" in b:
                sums.add("draft_accept", b["draft_accept"])
                sums.add("draft_positions", b["draft_positions"])
    if reporter:
        sums.add("computed_tokens", float(sum(b["num_computed_tokens"] for b in flat)))
        sums.add("real_tokens", float(sum(b["num_real_tokens"] for b in flat)))
    return sums


def step_sum_metrics(total: dict[str, Tensor]) -> dict[str, float]:
    """The metrics of the all-reduced :data:`STEP_SUMS` (module docstring)."""
    out = {
        "rollout/logprob_abs_diff": float(total["engine_gap"] / max(float(total["engine_gap_tokens"]), 1.0)),
        # fraction of the tokens the model computes (per pass) that are padding
        "perf/padding_frac": float(1.0 - total["real_tokens"] / max(float(total["computed_tokens"]), 1.0)),
    }
    if total["route_compared"] > 0:
        out["rollout/route_agreement"] = float(total["route_agree"] / total["route_compared"])
    if total["indexer_compared"] > 0:
        out["rollout/indexer_agreement"] = float(total["indexer_agree"] / total["indexer_compared"])
    if total["draft_positions"] > 0:
        out["spec/draft_accept_rate"] = float(total["draft_accept"] / total["draft_positions"])
    return out


def reduce_loss_metrics(
    per_minibatch: list[list[dict]], num_minibatches: int, mtp_loss: bool = False
) -> dict[str, float]:
    """Global step metrics from the loss functions' micro-batch metrics (``per_minibatch``: per
    mini-batch, this rank's micro-batch dicts; empty off the reporting ranks); four all-reduces
    (sums, which means were seen, min, max). Rules: module docstring."""
    dev = device()  # collectives need NCCL's device on GPU
    sums = NamedSums(_MEAN_KEYS + _LOSS_TOTALS, dev)
    seen = NamedSums(_MEAN_KEYS, dev)  # which metrics the loss reported at all
    lo = torch.tensor([math.inf], dtype=torch.float64, device=dev)
    hi = torch.tensor([-math.inf], dtype=torch.float64, device=dev)
    for micro in per_minibatch:
        for m in micro:
            w = m.get("num_seqs", 0.0)
            for k in _MEAN_KEYS:
                if k in m:
                    sums.add(k, w * m[k])
                    seen[k] = 1.0
            sums.add("num_seqs", w)
            sums.add("loss", m["loss"])
            sums.add("pg_loss", m.get("pg_loss", 0.0))
            sums.add("mtp_loss", m.get("mtp_loss", 0.0))
            if w > 0:
                lo[0] = min(lo[0].item(), m["ratio_min"])
                hi[0] = max(hi[0].item(), m["ratio_max"])
    total = sums.all_reduce()
    saw = seen.all_reduce()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    w = max(total["num_seqs"].item(), 1.0)
    out = {name: total[key].item() / w for key, name in LOSS_MEANS if saw[key] > 0}
    out["loss/total"] = total["loss"].item() / num_minibatches
    out["loss/policy"] = total["pg_loss"].item() / num_minibatches
    if mtp_loss:
        out["loss/mtp"] = total["mtp_loss"].item() / num_minibatches
    out["gspo/ratio_min"] = lo.item() if math.isfinite(lo.item()) else 1.0
    out["gspo/ratio_max"] = hi.item() if math.isfinite(hi.item()) else 1.0
    out["train/num_seqs"] = total["num_seqs"].item()
    return out


def mean_finite(values) -> float:
    """The mean of the finite values (None: not reported), NaN when there are none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return float(sum(vals) / len(vals)) if vals else float("nan")
