"""Policy-loss objectives, one small function each, registered by name with :func:`register_policy_loss`.

:func:`gspo_megatron.losses.policy_loss.policy_loss_flat` does the shared preparation once (masking,
per-sequence sums and their context-parallel all-reduce, advantages per token, TIS weights,
aggregation weights) and hands it to the objective of ``PolicyLossConfig.mode`` as a
:class:`LossInputs`; the objective returns J (:class:`ObjectiveTerms`). The KL and entropy terms, the
normalizer and the metrics stay shared. ``gspo.mode`` in the config is checked against this registry
(``config/loader.py`` asks :func:`policy_loss_modes`); the default clip range of a mode is its
``default_clip``. Adding a mode: one decorated function, here or in any module imported before the
config is loaded::

    @register_policy_loss("my_mode", default_clip=(0.2, 0.2))
    def my_mode(x: LossInputs, clip_low: float, clip_high: float) -> ObjectiveTerms:
        ratio = torch.exp(x.delta)                                    # [N]
        obj, cut = clipped_objective(ratio, x.adv_tok, clip_low, clip_high)
        return ObjectiveTerms((x.tok_w * obj).sum(), cut_tok=cut)

Shapes: N tokens of this (CP) rank, S sequences of the micro-batch (the same on every CP rank).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossInputs:
    """The shared preparation every objective reads (fp32; fp64 inputs stay fp64; 0 off the response).

    lp [N]: current log-probs (differentiable). delta [N]: lp - old (differentiable).
    seq [N]: sequence of each token (0 off the response). tok_w [N]: aggregation weight of each token,
    1/|y_i| (seq-mean-token-mean) or 1 (token-mean), 0 off the response.
    adv_seq [S] (None with per-token advantages), adv_tok [N]: advantages (detached).
    log_seq_ratio, seq_ratio [S]: log s_i = (sum_t delta over all CP ranks) / |y_i|, and s_i; differentiable
    only for ``sequence_ratio`` objectives. local_count [S]: this CP rank's response tokens of each
    sequence; count_safe [S]: |y_i| over all CP ranks, at least 1.
    tis_seq [S], tis_tok [N]: the engine/trainer importance weights (``tis_cap`` C; None without it),
    detached. ``tis_level`` "sequence": rho_i = exp(mean_t(old_t - engine_t)) (the geometric mean of
    the per-token ratios over the response tokens, never their product), w_i = min(rho_i, C)
    ("truncate") or rho_i * [rho_i <= C] ("mask": the sequence is dropped); tis_seq = w, and tis_tok
    = w_i on each token of sequence i. "token": w_t from rho_t = exp(old_t - engine_t) the same way,
    tis_tok = w_t, tis_seq None. A sequence objective multiplies J_i by tis_seq, a token objective
    each token's term by tis_tok.
    """

    lp: Tensor
    delta: Tensor
    seq: Tensor
    tok_w: Tensor
    adv_seq: Tensor | None
    adv_tok: Tensor
    log_seq_ratio: Tensor
    seq_ratio: Tensor
    local_count: Tensor
    count_safe: Tensor
    tis_seq: Tensor | None
    tis_tok: Tensor | None


@dataclass(frozen=True)
class ObjectiveTerms:
    """objective: scalar J summed over this rank's share (before the normalizer; maximized).
    cut_seq [S] / cut_tok [N]: where the clip cuts the gradient off (one of them; the clip-fraction
    metric is over sequences or this rank's response tokens). token_tis: unused (the TIS metrics
    follow ``tis_level``: over sequences at "sequence", over tokens at "token"); kept for hooks that
    set it."""

    objective: Tensor
    cut_seq: Tensor | None = None
    cut_tok: Tensor | None = None
    token_tis: bool = False


Objective = Callable[[LossInputs, float, float], ObjectiveTerms]


@dataclass(frozen=True)
class PolicyObjective:
    """A registered policy-loss mode.

    default_clip: (clip_low, clip_high) epsilons when the config leaves them null.
    sequence_ratio: J differentiates through the sequence ratio s_i (the per-sequence log-ratio sums
        travel in a differentiable CP all-reduce); such a mode needs per-sequence advantages [S] and
        aggregation seq-mean-token-mean (a sequence ratio has no tokens to sum).
    config_token_mean: the config allows ``gspo.loss_agg=token-mean`` with it.
    tis_level: the ``tis_level`` used when the config leaves it null ("sequence" or "token"); a
        ``sequence_ratio`` mode only takes "sequence" (it has no per-token terms to weight).
    """

    name: str
    fn: Objective
    default_clip: tuple[float, float]
    sequence_ratio: bool = False
    config_token_mean: bool = False
    help: str = ""
    tis_level: str = "token"


POLICY_LOSSES: dict[str, PolicyObjective] = {}
TIS_LEVELS = ("token", "sequence")
TIS_MODES = ("truncate", "mask")


def register_policy_loss(
    name: str,
    *,
    default_clip: tuple[float, float],
    sequence_ratio: bool = False,
    config_token_mean: bool = False,
    help: str = "",
    tis_level: str | None = None,
) -> Callable[[Objective], Objective]:
    """Decorator: register ``fn(inputs: LossInputs, clip_low, clip_high) -> ObjectiveTerms`` as mode
    ``name``. tis_level None: "sequence" for a ``sequence_ratio`` mode, else "token"."""
    level = tis_level or ("sequence" if sequence_ratio else "token")
    if level not in TIS_LEVELS or (sequence_ratio and level != "sequence"):
        raise ValueError(
            f"policy loss {name!r}: tis_level must be one of {TIS_LEVELS} ('sequence' for a "
            f"sequence_ratio mode), got {tis_level!r}"
        )

    def deco(fn: Objective) -> Objective:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = PolicyObjective(
            name, fn, (float(default_clip[0]), float(default_clip[1])), sequence_ratio, config_token_mean, help, level
        )
        return fn

    return deco


def policy_loss_modes() -> tuple[str, ...]:
    """The registered mode names, in registration order."""
    return tuple(POLICY_LOSSES)


def policy_objective(name: str, field: str = "mode") -> PolicyObjective:
    """The objective registered as ``name``; ValueError (one line naming ``field`` and the registered
    modes) otherwise."""
    if name in POLICY_LOSSES:
        return POLICY_LOSSES[name]
    close = difflib.get_close_matches(str(name), list(POLICY_LOSSES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"{field} must be one of {', '.join(repr(m) for m in POLICY_LOSSES)}; got {name!r}{hint}")


def clipped_objective(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """(min(ratio * A, clip(ratio, 1 - low, 1 + high) * A), whether the clip cuts the gradient off); elementwise."""
    obj = torch.minimum(ratio * adv, ratio.clamp(1.0 - low, 1.0 + high) * adv)
    cut = ((adv > 0) & (ratio > 1.0 + high)) | ((adv < 0) & (ratio < 1.0 - low))
    return obj, cut


@register_policy_loss("gspo", default_clip=(3e-4, 4e-4), sequence_ratio=True, help="sequence ratio")
def gspo(x: LossInputs, clip_low: float, clip_high: float) -> ObjectiveTerms:
    """J_i = min(s_i A_i, clip(s_i) A_i) (times tis_seq_i); this CP rank's share of sequence i is
    local_count_i / |y_i|, so the shares add up to J over the CP group."""
    assert x.adv_seq is not None  # a sequence_ratio objective: policy_loss_flat refuses token advantages
    obj_seq, cut_seq = clipped_objective(x.seq_ratio, x.adv_seq, clip_low, clip_high)
    if x.tis_seq is not None:
        obj_seq = obj_seq * x.tis_seq
    share = x.local_count.detach() / x.count_safe  # this CP rank's fraction of each sequence's tokens
    return ObjectiveTerms((share * obj_seq).sum(), cut_seq=cut_seq)


@register_policy_loss("gspo_token", default_clip=(3e-4, 4e-4), help="per-token GSPO", tis_level="sequence")
def gspo_token(x: LossInputs, clip_low: float, clip_high: float) -> ObjectiveTerms:
    """log s_it = sg[log s_i] + lp_t - sg[lp_t];  J = sum_t tok_w_t min(s_it A_it, clip(s_it) A_it) (times
    tis_tok_t: tis_seq_i at the default level "sequence")."""
    ratio_tok = torch.exp(x.log_seq_ratio.detach()[x.seq] + x.lp - x.lp.detach())
    obj_tok, cut_tok = clipped_objective(ratio_tok, x.adv_tok, clip_low, clip_high)
    if x.tis_tok is not None:
        obj_tok = obj_tok * x.tis_tok
    return ObjectiveTerms((x.tok_w * obj_tok).sum(), cut_tok=cut_tok)


@register_policy_loss("grpo", default_clip=(0.2, 0.2), config_token_mean=True, help="token ratio")
def grpo(x: LossInputs, clip_low: float, clip_high: float) -> ObjectiveTerms:
    """r_t = exp(lp_t - old_t);  J = sum_t tok_w_t min(r_t A_it, clip(r_t) A_it) (times tis_tok_t)."""
    obj_tok, cut_tok = clipped_objective(torch.exp(x.delta), x.adv_tok, clip_low, clip_high)
    if x.tis_tok is not None:
        obj_tok = obj_tok * x.tis_tok
    return ObjectiveTerms((x.tok_w * obj_tok).sum(), cut_tok=cut_tok, token_tis=True)
