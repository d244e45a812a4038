"""The terms of the policy loss, one small function each (:func:`gspo_megatron.losses.policy_loss.policy_loss_flat`
composes them; its module docstring states the whole loss).

Shapes: N tokens of this (CP) rank, S sequences of the micro-batch (the same on every CP rank).
Every token tensor is fp32 (fp64 inputs stay fp64) and exactly 0 off the response (:class:`Tokens`).

- :func:`sequence_sums`: the per-sequence sums [K, S] and their one CP all-reduce;
- :func:`sequence_ratio`: log s_i = sum_t (lp_t - old_t) / |y_i|, s_i = exp(log s_i);
- :func:`tis_at_level` / :func:`tis_weights`: truncated importance sampling, w = min(rho, C)
  ("truncate") or rho [rho <= C] ("mask");
- :func:`aggregation_weights`: tok_w_t = 1/|y_i| or 1, and :func:`denominator`: the normalizer;
- :func:`kl_term` (:func:`kl_estimate`: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d, d = lp - ref)
  and :func:`entropy_term`: sum_t tok_w_t x_t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_megatron.losses.reductions import all_reduce_sum, all_reduce_sum_, segment_sum

KL_ESTIMATORS = ("k1", "k2", "k3")


def tis_weights(log_rho: Tensor, cap: float, mode: str) -> tuple[Tensor, Tensor]:
    """Engine/trainer importance weights from log rho (any shape: [S] per-sequence mean log-ratios
    mean_t(old_t - engine_t), or [N] per-token old_t - engine_t). Returns (w, capped): "truncate"
    w = min(rho, cap), capped = rho >= cap; "mask" w = rho * [rho <= cap], capped = rho > cap (dropped)."""
    rho = torch.exp(log_rho)
    if mode == "mask":
        capped = rho > cap
        return torch.where(capped, torch.zeros_like(rho), rho), capped
    return rho.clamp(max=cap), rho >= cap


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimator of KL(pi_theta || pi_ref) from samples of pi_theta (Schulman's k1/k2/k3)."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(-d) + d
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


@dataclass(frozen=True)
class Tokens:
    """This rank's N tokens, prepared once: fp32 math (``dtype``; fp64 inputs stay fp64), every value
    exactly 0 off the response (NaN padding cannot leak).

    mask [N] bool: response tokens; maskf [N]: the same as ``dtype``; seq [N] int64: each token's
    sequence (0 off the response); lp [N]: current log-probs (differentiable); old [N], ref [N] (None
    without ``ref_logprobs``): detached; delta [N] = lp - old (differentiable)."""

    dtype: torch.dtype
    mask: Tensor
    maskf: Tensor
    seq: Tensor
    zero: Tensor
    lp: Tensor
    old: Tensor
    ref: Tensor | None
    delta: Tensor

    @classmethod
    def prepare(
        cls,
        logprobs: Tensor,
        old_logprobs: Tensor,
        ref_logprobs: Tensor | None,
        response_mask: Tensor,
        seq_index: Tensor,
    ) -> Tokens:
        f32 = torch.promote_types(logprobs.dtype, torch.float32)  # fp32 math; fp64 inputs stay fp64
        mask = response_mask != 0
        seq = torch.where(mask, seq_index.long(), torch.zeros_like(seq_index, dtype=torch.long))
        zero = torch.zeros((), dtype=f32, device=logprobs.device)

        def masked(t: Tensor) -> Tensor:
            return torch.where(mask, t.to(f32), zero)

        lp = masked(logprobs)
        old = masked(old_logprobs.detach())
        ref = masked(ref_logprobs.detach()) if ref_logprobs is not None else None
        return cls(f32, mask, mask.to(f32), seq, zero, lp, old, ref, lp - old)

    def masked(self, t: Tensor) -> Tensor:
        """t [N] as ``dtype``, exactly 0 off the response."""
        return torch.where(self.mask, t.to(self.dtype), self.zero)


@dataclass(frozen=True)
class SequenceSums:
    """Per-sequence sums over every CP rank (:func:`sequence_sums`).

    local [K, S]: this rank's sums of the K rows (row 1: this rank's response tokens per sequence).
    sums: row name -> [S] over the CP group: ``logratio`` sum_t (lp - old) (differentiable for a
    ``sequence_ratio`` mode), ``count`` |y_i|, ``k3_old`` sum_t k3(old || lp), and when given
    ``engine_gap`` sum_t (old - engine), ``engine_absgap`` sum_t |old - engine|, ``entropy``,
    ``kl_ref`` sum_t KL_ref. engine_gap_tok [N]: old - engine per token (None without engine
    log-probs). count [S]: |y_i| (detached); valid [S]: |y_i| > 0; count_safe [S]: max(|y_i|, 1);
    num_valid: scalar count of valid sequences."""

    local: Tensor
    sums: dict[str, Tensor]
    engine_gap_tok: Tensor | None
    count: Tensor
    valid: Tensor
    count_safe: Tensor
    num_valid: Tensor


def sequence_sums(
    tok: Tokens,
    num_seqs: int,
    kl_estimator: str,
    sequence_ratio: bool,
    cp_group: dist.ProcessGroup | None,
    *,
    old_logprobs: Tensor,
    engine_logprobs: Tensor | None,
    entropy: Tensor | None,
) -> SequenceSums:
    """One CP all-reduce of per-sequence sums [K, S] (rows: :class:`SequenceSums`); differentiable
    (its backward sums the upstream gradients over the group) only for a ``sequence_ratio`` mode,
    whose J reads log s_i = sum_t (lp - old) / |y_i| over every CP rank's tokens."""
    rows: dict[str, Tensor] = {"logratio": tok.delta if sequence_ratio else tok.delta.detach(), "count": tok.maskf}
    with torch.no_grad():
        rows["k3_old"] = tok.masked(kl_estimate(tok.old, tok.lp, "k3"))  # KL(old || new) from old's samples
        if engine_logprobs is not None:
            rows["engine_gap"] = tok.masked(old_logprobs.detach() - engine_logprobs.detach())
            rows["engine_absgap"] = rows["engine_gap"].abs()
        if entropy is not None:
            rows["entropy"] = tok.masked(entropy.detach())
        if tok.ref is not None:
            rows["kl_ref"] = tok.masked(kl_estimate(tok.lp, tok.ref, kl_estimator))
    names = list(rows)
    local = segment_sum(torch.stack([rows[k] for k in names]), tok.seq, num_seqs)
    if sequence_ratio:
        seq_sums = all_reduce_sum(local, cp_group)
    else:
        seq_sums = all_reduce_sum_(local.detach().clone(), cp_group)
    sums = dict(zip(names, seq_sums.unbind(0)))
    count = sums["count"].detach()
    valid = count > 0
    return SequenceSums(
        local=local,
        sums=sums,
        engine_gap_tok=rows.get("engine_gap"),
        count=count,
        valid=valid,
        count_safe=count.clamp(min=1.0),
        num_valid=valid.sum().to(tok.dtype),
    )


def denominator(
    normalizer: float | Tensor | None, aggregation: str, s: SequenceSums, tok: Tokens, checks: dict[str, Tensor]
) -> Tensor:
    """The loss's divisor (scalar, ``tok.dtype``): ``normalizer`` (the global sequence or token count),
    or None: this micro-batch's valid sequences ("seq-mean-token-mean") or response tokens
    ("token-mean"), at least 1. A tensor normalizer is checked at the metrics' sync (``checks``)."""
    if normalizer is None:
        default = s.num_valid if aggregation == "seq-mean-token-mean" else s.count.sum()
        return default.clamp(min=1.0)
    if isinstance(normalizer, Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a scalar, got shape {tuple(normalizer.shape)}")
        denom = normalizer.detach().to(device=tok.zero.device, dtype=tok.dtype).reshape(())
        checks["normalizer"] = ~(denom > 0) | ~torch.isfinite(denom)  # checked at the metrics' sync
        return denom
    if not (math.isfinite(normalizer) and normalizer > 0):
        raise ValueError(f"normalizer must be > 0 (global sequence or token count), got {normalizer}")
    return torch.tensor(float(normalizer), dtype=tok.dtype, device=tok.zero.device)


def split_advantages(
    advantages: Tensor, token_advantages: bool, s: SequenceSums, tok: Tokens
) -> tuple[Tensor | None, Tensor]:
    """(adv_seq [S] or None for per-token advantages, adv_tok [N]), detached, 0 on empty sequences
    and off the response; adv_tok_t = adv_seq[seq_t] for per-sequence advantages."""
    if token_advantages:
        return None, tok.masked(advantages.detach())
    adv_seq = torch.where(s.valid, advantages.detach().to(tok.dtype), tok.zero)  # [S]; empty sequences' A unused
    return adv_seq, adv_seq[tok.seq]


def sequence_ratio(s: SequenceSums) -> tuple[Tensor, Tensor]:
    """(log s_i, s_i) [S]: log s_i = sum_t (lp_t - old_t) / |y_i| over every CP rank's tokens (the
    length-normalized sequence ratio); differentiable for a ``sequence_ratio`` mode."""
    log_seq_ratio = s.sums["logratio"] / s.count_safe
    return log_seq_ratio, torch.exp(log_seq_ratio)


def tis_at_level(
    level: str | None, cap: float | None, mode: str, s: SequenceSums, tok: Tokens
) -> tuple[tuple[Tensor, Tensor] | None, Tensor | None, Tensor | None]:
    """Truncated importance sampling (``tis_level`` ``level``, ``tis_cap`` ``cap``, ``tis_mode``
    ``mode``): (the (w, capped) of :func:`tis_weights`, [S] or [N]; tis_seq [S]; tis_tok [N]).
    "sequence": log rho_i = sum_t (old_t - engine_t) / |y_i| over every CP rank, tis_seq = w,
    tis_tok_t = w_{seq_t}; "token": log rho_t = old_t - engine_t, tis_seq None, tis_tok = w. All None
    without a cap."""
    if cap is None:
        return None, None, None
    assert s.engine_gap_tok is not None  # checked: tis_cap needs engine_logprobs
    sequence = level == "sequence"
    tis = tis_weights(s.sums["engine_gap"] / s.count_safe if sequence else s.engine_gap_tok, cap, mode)
    if sequence:
        return tis, tis[0], tis[0][tok.seq]
    return tis, None, tis[0]


def aggregation_weights(tok: Tokens, count_safe: Tensor, aggregation: str) -> Tensor:
    """Per-token aggregation weight tok_w [N]: 1/|y_i| ("seq-mean-token-mean": each sequence's token
    mean) or 1 ("token-mean"), 0 off the response; a term's aggregate is sum_t tok_w_t x_t."""
    return tok.maskf / count_safe[tok.seq] if aggregation == "seq-mean-token-mean" else tok.maskf


def kl_term(tok_w: Tensor, lp: Tensor, ref: Tensor, estimator: str) -> Tensor:
    """sum_t tok_w_t KL_t(lp || ref) (scalar, differentiable through lp [N]); KL_t: :func:`kl_estimate`."""
    return (tok_w * kl_estimate(lp, ref, estimator)).sum()


def entropy_term(tok_w: Tensor, entropy: Tensor) -> Tensor:
    """sum_t tok_w_t H_t (scalar, differentiable through the masked entropy [N])."""
    return (tok_w * entropy).sum()
