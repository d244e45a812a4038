"""The policy-gradient losses: GSPO (sequence ratio), GSPO-token, and the GRPO baseline.

The objective J of each mode is a small registered function (:mod:`gspo_megatron.losses.objectives`);
the shared preparation and the other terms (masking, per-sequence sums and their CP all-reduce, the
sequence ratio, TIS weights, the aggregation weights and normalizer, the KL / entropy terms) are one
small function each in :mod:`gspo_megatron.losses.loss_terms`; :func:`policy_loss_flat` checks the
inputs, composes the terms and computes the metrics.

Core representation (covers padded, packed/THD and context-parallel batches alike): flat per-token
tensors [N] with ``seq_index`` [N] (the micro-batch sequence each token belongs to; masked tokens may
carry any value) and advantages per sequence [S] (or per token [N]). :func:`policy_loss` is the
[B, T] wrapper (one sequence per row).

Loss = -J + kl_coef * KL_ref - entropy_coef * H, each term aggregated the same way:

- "seq-mean-token-mean" (default): sum over sequences with >= 1 response token of that sequence's
  token mean, divided by ``normalizer`` (default: the number of such sequences in the micro-batch).
- "token-mean": sum over all response tokens divided by ``normalizer`` (default: the token count).
  Only for the token-ratio modes; a ``sequence_ratio`` mode ("gspo") refuses it (a sequence ratio has
  no tokens to sum).

With ``normalizer`` = the count over the whole global batch (sequences, or tokens for "token-mean"),
the sum of the losses of all micro-batches and DP ranks is exactly the global-batch loss.

Built-in modes (s = sequence ratio, r = token ratio, A = advantage, clip to [1 - clip_low, 1 + clip_high]):

- "gspo":       log s_i = (1/|y_i|) sum_t (logp - old);  J_i = min(s_i A_i, clip(s_i) A_i)
- "gspo_token": log s_it = sg[log s_i] + logp_t - sg[logp_t];  J_i = mean_t min(s_it A_it, clip(s_it) A_it)
- "grpo":       r_t = exp(logp_t - old_t);  J_i = mean_t min(r_t A_it, clip(r_t) A_it)

Truncated importance sampling (engine vs trainer), cap C (``tis_cap``), detached weights multiplying J.
``tis_level`` "sequence" (default of "gspo" and "gspo_token"): rho_i = exp(mean_t(old_t - engine_t)),
the geometric mean of the per-token ratios over the response tokens (length-normalized like s_i;
never the product exp(sum_t), whose spread grows with the length), one weight per sequence (this
keeps gspo_token == gspo for uniform token advantages); "token" (default of "grpo"; not for "gspo"):
rho_t = exp(old_t - engine_t) per token. ``tis_mode`` "truncate": w = min(rho, C); "mask": w = rho
where rho <= C, else 0 (the sequence, or token, is dropped from the loss). The sequence weight uses
the CP-all-reduced per-sequence sum (exact over CP); each sequence lives on one DP rank.

KL to the reference policy, per token with d = logp - ref: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d.

Context parallel (``cp_group``): every CP rank passes its own tokens with the same sequence numbering,
advantages and normalizer. Per sequence, (sum of log-ratios, token count) and a few detached metric
sums are all-reduced over the CP group in one collective ([K, S] numbers; the log-ratio sum is
differentiable). Each rank's loss is its share: sequence terms are weighted by the rank's fraction
of the sequence's tokens, token terms cover the rank's tokens. Shares add up to the CP1 loss, and
because the all-reduce's backward sums the upstream gradients over the group, the gradients (each
rank into its own tokens only) add up to the CP1 gradient.

Metrics (Python floats, one device sync): sequence-level ones (ratio mean/min/max, gspo clip fraction,
approx KL to old, entropy, KL to ref, engine gap, TIS) are exact over the micro-batch across CP ranks;
token clip fraction ("gspo_token", "grpo") is CP-rank-local. All are micro-batch-local (not reduced
over micro-batches or DP ranks; the trainer averages them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from gspo_megatron.losses.distill_loss import DistillTerm, distill_loss, distill_objective
from gspo_megatron.losses.loss_terms import (
    KL_ESTIMATORS,
    Tokens,
    aggregation_weights,
    denominator,
    entropy_term,
    kl_term,
    sequence_ratio,
    sequence_sums,
    split_advantages,
    tis_at_level,
)
from gspo_megatron.losses.loss_terms import kl_estimate as kl_estimate  # (re-exported: gspo_megatron.losses)
from gspo_megatron.losses.loss_terms import tis_weights as tis_weights  # (re-exported)
from gspo_megatron.losses.objectives import TIS_LEVELS, TIS_MODES, LossInputs, ObjectiveTerms, policy_objective

AGGREGATIONS = ("seq-mean-token-mean", "token-mean")


@dataclass(frozen=True)
class PolicyLossConfig:
    """Hyper-parameters of the loss. ``mode``: a registered objective (``objectives.policy_loss_modes()``).
    ``clip_low``/``clip_high`` None -> the mode's ``default_clip`` (gspo / gspo_token: 3e-4 / 4e-4 as in
    the paper; grpo: 0.2 / 0.2). ``tis_cap`` None: no TIS. ``tis_level`` None -> the mode's default
    ("sequence" for gspo / gspo_token, "token" for grpo); ``tis_mode``: "truncate" or "mask"."""

    mode: str = "gspo"
    clip_low: float | None = None
    clip_high: float | None = None
    aggregation: str = "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    tis_level: str | None = None
    tis_mode: str = "truncate"
    distill_coef: float = 0.0
    distill_loss: str = "reverse_kl"
    reward_coef: float = 1.0

    def __post_init__(self) -> None:
        objective = policy_objective(self.mode, "mode")
        low, high = objective.default_clip
        clip_low = low if self.clip_low is None else float(self.clip_low)
        object.__setattr__(self, "clip_low", clip_low)
        object.__setattr__(self, "clip_high", high if self.clip_high is None else float(self.clip_high))
        for name in ("clip_low", "clip_high"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(
                    f"{name} must be a finite epsilon > 0 (clip range [1 - clip_low, 1 + clip_high]), got {v}"
                )
        if clip_low >= 1:
            raise ValueError(f"clip_low must be < 1 (lower clip bound 1 - clip_low > 0), got {self.clip_low}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if objective.sequence_ratio and self.aggregation != "seq-mean-token-mean":
            raise ValueError(
                f"aggregation={self.aggregation!r} sums token terms across sequences, which is incompatible "
                f"with mode={self.mode!r} (one length-normalized ratio per sequence); use 'seq-mean-token-mean'"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        for name in ("kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise ValueError(f"{name} must be finite, got {v}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.tis_cap is not None and not (math.isfinite(self.tis_cap) and self.tis_cap > 0):
            raise ValueError(f"tis_cap must be a finite value > 0 (or None), got {self.tis_cap}")
        level = objective.tis_level if self.tis_level is None else self.tis_level
        if level not in TIS_LEVELS:
            raise ValueError(f"tis_level must be one of {TIS_LEVELS} (or None), got {self.tis_level!r}")
        if objective.sequence_ratio and level != "sequence":
            raise ValueError(
                f"tis_level={level!r} weights tokens, but mode={self.mode!r} has one ratio per "
                "sequence; use tis_level='sequence'"
            )
        object.__setattr__(self, "tis_level", level)
        if self.tis_mode not in TIS_MODES:
            raise ValueError(f"tis_mode must be one of {TIS_MODES}, got {self.tis_mode!r}")
        for name in ("distill_coef", "reward_coef"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite value >= 0, got {v}")
        distill_loss(self.distill_loss)  # a registered distillation objective (ValueError naming it)


class PolicyLossOutput(NamedTuple):
    """``loss, metrics = policy_loss(...)``."""

    loss: Tensor  # scalar, differentiable: this rank's share of the global-batch loss
    metrics: dict[str, float]


def _check_shapes(n: int, named: dict[str, Tensor | None]) -> None:
    for name, t in named.items():
        if t is not None and t.shape != (n,):
            raise ValueError(f"{name} must have shape [{n}] (one value per token), got {tuple(t.shape)}")


def _check_inputs(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    seq_index: Tensor,
    num_seqs: int,
    cfg: PolicyLossConfig,
    sequence_ratio: bool,
    ref_logprobs: Tensor | None,
    entropy: Tensor | None,
    engine_logprobs: Tensor | None,
    token_advantages: bool | None,
    teacher_logprobs: Tensor | None = None,
) -> bool:
    """Refuse inputs :func:`policy_loss_flat` cannot use (ValueError / TypeError naming the argument):
    every per-token tensor [N], ``advantages`` [S] or [N] (not [N] for a ``sequence_ratio`` mode), the
    inputs a nonzero ``kl_coef`` / ``entropy_coef`` / a ``tis_cap`` needs, an integer ``seq_index``.
    Returns whether ``advantages`` is per token (None infers it: per token when [N] and N != S)."""
    n = logprobs.shape[0] if logprobs.dim() == 1 else -1
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be 1-D [N], got {tuple(logprobs.shape)}")
    _check_shapes(
        n,
        {
            "old_logprobs": old_logprobs,
            "response_mask": response_mask,
            "seq_index": seq_index,
            "ref_logprobs": ref_logprobs,
            "entropy": entropy,
            "engine_logprobs": engine_logprobs,
            "teacher_logprobs": teacher_logprobs,
        },
    )
    if not isinstance(num_seqs, int) or num_seqs < 1:
        raise ValueError(f"num_seqs must be a positive int, got {num_seqs!r}")
    if token_advantages is None:  # infer; when N == S the per-sequence reading wins
        token_advantages = advantages.shape == (n,) and n != num_seqs
    want = (n,) if token_advantages else (num_seqs,)
    if advantages.shape != want:
        raise ValueError(
            f"advantages must have shape [{num_seqs}] (per sequence) or [{n}] (per token), "
            f"got {tuple(advantages.shape)}"
        )
    if token_advantages and sequence_ratio:
        raise ValueError(
            f"advantages must be per sequence [S] for mode={cfg.mode!r}; use mode='gspo_token' for token advantages"
        )
    if cfg.kl_coef != 0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 needs ref_logprobs")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef != 0 needs entropy")
    if cfg.tis_cap is not None and engine_logprobs is None:
        raise ValueError("tis_cap is set but engine_logprobs is None")
    if cfg.distill_coef != 0 and teacher_logprobs is None:
        raise ValueError("distill_coef != 0 needs teacher_logprobs")
    if seq_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"seq_index must be an integer tensor, got {seq_index.dtype}")
    return bool(token_advantages)


def _total_loss(
    objective: Tensor, cfg: PolicyLossConfig, tok_w: Tensor, tok: Tokens, entropy: Tensor | None, denom: Tensor
) -> Tensor:
    """(-J + kl_coef * KL_ref - entropy_coef * H) / denom, each term aggregated by ``tok_w``."""
    loss = -objective
    if cfg.kl_coef != 0:
        assert tok.ref is not None  # checked: kl_coef != 0 needs ref_logprobs
        loss = loss + cfg.kl_coef * kl_term(tok_w, tok.lp, tok.ref, cfg.kl_estimator)
    if cfg.entropy_coef != 0:
        assert entropy is not None  # checked: entropy_coef != 0 needs entropy
        loss = loss - cfg.entropy_coef * entropy_term(tok_w, tok.masked(entropy))
    return loss / denom


def _finite_checks(
    checks: dict[str, Tensor],
    inputs: dict[str, Tensor | None],
    advantages: Tensor,
    token_advantages: bool,
    tok: Tokens,
    valid: Tensor,
) -> None:
    """checks[name] = whether input ``name`` is non-finite on a response token (advantages: on a
    response token, or a valid sequence); one flag each, read at the metrics' sync."""
    for name, t in inputs.items():
        if t is not None:
            checks[name] = (~torch.isfinite(t.detach()) & tok.mask).any()
    adv_ok = torch.isfinite(advantages.detach())
    checks["advantages"] = (~adv_ok & tok.mask).any() if token_advantages else (~adv_ok & valid).any()


def policy_loss_flat(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    seq_index: Tensor,
    num_seqs: int,
    config: PolicyLossConfig,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    engine_logprobs: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    check_finite: bool = True,
    token_advantages: bool | None = None,
    teacher_logprobs: Tensor | None = None,
    topk_logprobs: tuple[Tensor, Tensor] | None = None,
) -> PolicyLossOutput:
    """The loss on flat tokens.

    Args:
        logprobs: [N] current policy log-probs (differentiable).
        old_logprobs, ref_logprobs, engine_logprobs: [N] (detached inside).
        advantages: [S] per sequence, or [N] per token (not for a ``sequence_ratio`` mode: "gspo").
        response_mask: [N] nonzero on response tokens.
        seq_index: [N] int, in [0, num_seqs) on response tokens.
        num_seqs: S, sequences in the micro-batch (the same on every CP rank).
        entropy: [N] per-token entropy (differentiable), required when entropy_coef != 0.
        normalizer: global count (see module doc); None -> this micro-batch's count.
        cp_group: context-parallel group (None: all tokens of each sequence are here).
        check_finite: raise if any input is non-finite on a response token (no extra sync: it
            rides on the metrics' sync).
        token_advantages: whether ``advantages`` is per token; None infers it from the shape
            (per sequence when N == S).
        teacher_logprobs: [N] a distillation teacher's log-probs of the sampled tokens, needed when
            ``distill_coef`` != 0 (``losses.distill_loss``: + distill_coef * J_token(A^d)).
        topk_logprobs: (student [N, K] differentiable, teacher [N, K]) log-probs of the teacher's
            top-k tokens, for a top-k ``distill_loss``.
    Returns (loss, metrics): see the module docstring.
    """
    cfg = config
    spec = policy_objective(cfg.mode, "mode")
    token_advantages = _check_inputs(
        logprobs,
        old_logprobs,
        advantages,
        response_mask,
        seq_index,
        num_seqs,
        cfg,
        spec.sequence_ratio,
        ref_logprobs,
        entropy,
        engine_logprobs,
        token_advantages,
        teacher_logprobs,
    )
    if cfg.reward_coef != 1.0:  # distill.reward_coef: the task reward's weight (0: distillation alone)
        advantages = advantages * cfg.reward_coef
    tok = Tokens.prepare(logprobs, old_logprobs, ref_logprobs, response_mask, seq_index)
    s = sequence_sums(
        tok,
        num_seqs,
        cfg.kl_estimator,
        spec.sequence_ratio,
        cp_group,
        old_logprobs=old_logprobs,
        engine_logprobs=engine_logprobs,
        entropy=entropy,
    )
    checks: dict[str, Tensor] = {}
    denom = denominator(normalizer, cfg.aggregation, s, tok, checks)
    adv_seq, adv_tok = split_advantages(advantages, token_advantages, s, tok)
    log_seq_ratio, seq_ratio = sequence_ratio(s)
    tis, tis_seq, tis_tok = tis_at_level(cfg.tis_level, cfg.tis_cap, cfg.tis_mode, s, tok)
    tok_w = aggregation_weights(tok, s.count_safe, cfg.aggregation)
    assert cfg.clip_low is not None and cfg.clip_high is not None  # resolved by PolicyLossConfig.__post_init__
    inputs = LossInputs(
        lp=tok.lp,
        delta=tok.delta,
        seq=tok.seq,
        tok_w=tok_w,
        adv_seq=adv_seq,
        adv_tok=adv_tok,
        log_seq_ratio=log_seq_ratio,
        seq_ratio=seq_ratio,
        local_count=s.local[1],
        count_safe=s.count_safe,
        tis_seq=tis_seq,
        tis_tok=tis_tok,
    )
    terms = spec.fn(inputs, cfg.clip_low, cfg.clip_high)
    objective, distill = terms.objective, None
    if cfg.distill_coef != 0:  # coef 0: not computed, the loss is the policy loss bitwise
        assert teacher_logprobs is not None  # checked: distill_coef != 0 needs teacher_logprobs
        distill = distill_objective(
            spec,
            inputs,
            tok.old,
            teacher_logprobs,
            tok.mask,
            cfg.distill_loss,
            cfg.clip_low,
            cfg.clip_high,
            topk_logprobs,
        )
        objective = objective + cfg.distill_coef * distill.objective
    loss = _total_loss(objective, cfg, tok_w, tok, entropy, denom)
    if check_finite:
        named = {
            "logprobs": logprobs,
            "old_logprobs": old_logprobs,
            "ref_logprobs": ref_logprobs,
            "entropy": entropy,
            "engine_logprobs": engine_logprobs,
            "teacher_logprobs": teacher_logprobs,
        }
        _finite_checks(checks, named, advantages, token_advantages, tok, s.valid)
    metrics = _metrics(
        cfg, loss, objective / denom, s.sums, s.valid, s.num_valid, seq_ratio, terms, tok.mask, tis, checks, distill
    )
    return PolicyLossOutput(loss=loss, metrics=metrics)


def _metrics(
    cfg: PolicyLossConfig,
    loss: Tensor,
    objective: Tensor,
    sums: dict[str, Tensor],
    valid: Tensor,
    num_valid: Tensor,
    seq_ratio: Tensor,
    terms: ObjectiveTerms,
    mask: Tensor,
    tis: tuple[Tensor, Tensor] | None,
    checks: dict[str, Tensor],
    distill: DistillTerm | None = None,
) -> dict[str, float]:
    """All metrics in one tensor and one device sync; raises for failed ``checks`` (naming the argument).
    tis: (weights, capped) of :func:`tis_weights` at ``cfg.tis_level`` ([S] or [N]), or None."""
    cut_seq, cut_tok = terms.cut_seq, terms.cut_tok
    with torch.no_grad():
        f32 = torch.float32
        nv = num_valid.clamp(min=1.0)
        count_safe = sums["count"].clamp(min=1.0)
        vf = valid.to(f32)
        ntok = mask.sum().clamp(min=1).to(f32)

        def seq_mean(per_seq: Tensor) -> Tensor:
            return (per_seq.to(f32) * vf).sum() / nv

        if cut_seq is not None:
            clip_fraction = seq_mean(cut_seq)
        else:
            assert cut_tok is not None  # an objective sets one of the two
            clip_fraction = (cut_tok & mask).sum() / ntok
        sr = seq_ratio.detach()
        any_valid = num_valid > 0
        one = sr.new_ones(())
        vals: dict[str, Tensor] = {
            "loss": loss.detach(),
            "pg_loss": -objective.detach(),
            "num_seqs": num_valid,
            "num_tokens": sums["count"].sum(),
            "empty_mask": (~any_valid).to(f32),
            "ratio_mean": torch.where(any_valid, seq_mean(sr), one),
            "ratio_min": torch.where(any_valid, torch.where(valid, sr, sr.new_full((), math.inf)).min(), one),
            "ratio_max": torch.where(any_valid, torch.where(valid, sr, sr.new_full((), -math.inf)).max(), one),
            "approx_kl_old": seq_mean(sums["k3_old"] / count_safe),
            "clip_fraction": clip_fraction,
        }
        for key, name in (("entropy", "entropy"), ("kl_ref", "kl_ref"), ("engine_absgap", "engine_logprob_absdiff")):
            if key in sums:
                vals[name] = seq_mean(sums[key] / count_safe)
        if tis is not None:
            if cfg.tis_level == "token":
                vals["tis_weight_mean"] = (tis[0] * mask).sum() / ntok
                vals["tis_capped_fraction"] = (tis[1] & mask).sum() / ntok
            else:
                vals["tis_weight_mean"] = seq_mean(tis[0])
                vals["tis_capped_fraction"] = seq_mean(tis[1])
        if distill is not None:  # token means over this (CP) rank's response tokens
            vals["distill_reverse_kl"] = distill.reverse_kl_sum / ntok
            if distill.cut_tok is not None:  # the share of response tokens whose distillation term is clipped
                vals["distill_clip_fraction"] = (distill.cut_tok & mask).sum() / ntok
        for name, flag in checks.items():
            vals["_bad_" + name] = flag
        floats = torch.stack([v.to(f32).reshape(()) for v in vals.values()]).tolist()
    out = dict(zip(vals, floats))
    bad = [name for name in checks if out.pop("_bad_" + name) != 0.0]
    if "normalizer" in bad:
        raise ValueError("normalizer must be a finite value > 0 (global sequence or token count)")
    if bad:
        raise ValueError(f"non-finite values on response tokens in: {', '.join(bad)}")
    return out


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    mode: str = "gspo",
    clip_low: float | None = None,
    clip_high: float | None = None,
    aggregation: str = "seq-mean-token-mean",
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    engine_logprobs: Tensor | None = None,
    tis_cap: float | None = None,
    tis_level: str | None = None,
    tis_mode: str = "truncate",
    normalizer: float | Tensor | None = None,
    cp_group: dist.ProcessGroup | None = None,
    check_finite: bool = True,
    teacher_logprobs: Tensor | None = None,
    distill_coef: float = 0.0,
    distill_loss: str = "reverse_kl",
    reward_coef: float = 1.0,
) -> PolicyLossOutput:
    """Policy loss on a padded batch: one sequence per row.

    Args:
        logprobs, old_logprobs, response_mask: [B, T]; ref_logprobs, entropy, engine_logprobs,
            teacher_logprobs: [B, T].
        advantages: [B] (per sequence) or [B, T] (per token; not for a ``sequence_ratio`` mode: "gspo").
        Other options: see :class:`PolicyLossConfig` and :func:`policy_loss_flat`.
    Returns ``(loss, metrics)``: loss = -J (scalar tensor), metrics: dict of floats.
    """
    cfg = PolicyLossConfig(
        mode=mode,
        clip_low=clip_low,
        clip_high=clip_high,
        aggregation=aggregation,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        tis_cap=tis_cap,
        tis_level=tis_level,
        tis_mode=tis_mode,
        distill_coef=distill_coef,
        distill_loss=distill_loss,
        reward_coef=reward_coef,
    )
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    b, t = logprobs.shape
    for name, x in {
        "old_logprobs": old_logprobs,
        "response_mask": response_mask,
        "ref_logprobs": ref_logprobs,
        "entropy": entropy,
        "engine_logprobs": engine_logprobs,
        "teacher_logprobs": teacher_logprobs,
    }.items():
        if x is not None and x.shape != (b, t):
            raise ValueError(f"{name} must have the shape of logprobs [B, T] = [{b}, {t}], got {tuple(x.shape)}")
    if advantages.shape == (b, t):
        if policy_objective(cfg.mode).sequence_ratio:
            raise ValueError(
                f"advantages must be [B] for mode={mode!r}; token advantages [B, T] need mode='gspo_token'"
            )
        adv = advantages.reshape(-1)
    elif advantages.shape == (b,):
        adv = advantages
    else:
        raise ValueError(f"advantages must be [B] = [{b}] or [B, T] = [{b}, {t}], got {tuple(advantages.shape)}")
    seq_index = torch.arange(b, device=logprobs.device).repeat_interleave(t)

    def flat(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.reshape(-1)

    return policy_loss_flat(
        logprobs.reshape(-1),
        old_logprobs.reshape(-1),
        adv,
        response_mask.reshape(-1),
        seq_index,
        b,
        cfg,
        ref_logprobs=flat(ref_logprobs),
        entropy=flat(entropy),
        engine_logprobs=flat(engine_logprobs),
        normalizer=normalizer,
        cp_group=cp_group,
        check_finite=check_finite,
        token_advantages=advantages.dim() == 2,
        teacher_logprobs=flat(teacher_logprobs),
    )
