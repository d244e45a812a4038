"""On-policy distillation objectives: a teacher scores the student's own sampled tokens, registered by
name with :func:`register_distill_loss` (``distill.loss``), as the policy losses are
(:mod:`gspo_megatron.losses.objectives`).

A distillation objective turns the student's behaviour log-probs ``old`` [N] and the teacher's
log-probs ``teacher`` [N] of the same sampled tokens (both 0 off the response) into a dense
per-token advantage A^d [N] (detached). :func:`distill_objective` puts it through the policy's own
ratio and clip: the registered policy mode's per-token form (``gspo`` and any other
``sequence_ratio`` mode: GSPO-token's s_it = sg[s_i] pi_t / sg[pi_t], whose value is GSPO's s_i;
``grpo``: r_t), with the mode's clip range and TIS weights, so that the importance ratio and clipping
of the student stay the policy loss's. The loss of a run is

    J = J_policy(reward_coef * A_seq) + coef * J_token(A^d)

(``distill.reward_coef``, ``distill.coef``); with ``coef = 0`` the term is not computed at all and the
loss is today's GSPO bitwise. ``reward_coef = 0`` is distillation alone.

Shapes: N tokens of this (CP) rank. A^d is per token, so context parallelism needs no extra
collective (each CP rank's tokens carry their own advantage; GSPO-token's s_i is the CP-exact one).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import Tensor

from gspo_megatron.losses.objectives import POLICY_LOSSES, LossInputs, ObjectiveTerms, PolicyObjective

DistillAdvantage = Callable[[Tensor, Tensor, Tensor], Tensor]  # (old [N], teacher [N], mask [N] bool) -> A^d [N]


@dataclass(frozen=True)
class DistillObjective:
    """A registered ``distill.loss``. ``topk`` False: ``fn(old, teacher, mask) -> A^d`` [N], a dense
    advantage through the policy's ratio and clip. ``topk`` True: ``fn(student, teacher, mask) -> D``
    [N], a differentiable divergence per token from the student's [N, K] log-probs of the teacher's
    top-k tokens (``distill.topk``) and the teacher's [N, K]; the loss adds ``coef * D`` aggregated
    like the KL term (per token weight ``tok_w``)."""

    name: str
    fn: Callable[[Tensor, Tensor, Tensor], Tensor]
    help: str = ""
    topk: bool = False


DISTILL_LOSSES: dict[str, DistillObjective] = {}


def register_distill_loss(
    name: str, *, help: str = "", topk: bool = False
) -> Callable[[Callable[[Tensor, Tensor, Tensor], Tensor]], Callable[[Tensor, Tensor, Tensor], Tensor]]:
    """Decorator: register ``fn`` as ``distill.loss`` ``name`` (:class:`DistillObjective`: an
    advantage ``fn(old, teacher, mask) -> A^d`` [N], detached and 0 off the response; with ``topk``
    a divergence ``fn(student [N, K], teacher [N, K], mask) -> D`` [N], differentiable)."""

    def deco(fn):
        if name in DISTILL_LOSSES:
            raise ValueError(f"distillation loss {name!r} is already registered")
        DISTILL_LOSSES[name] = DistillObjective(name, fn, help, topk)
        return fn

    return deco


def distill_loss_names() -> tuple[str, ...]:
    return tuple(DISTILL_LOSSES)


def distill_loss(name: str) -> DistillObjective:
    """The objective registered as ``name``; ValueError naming ``distill.loss`` otherwise."""
    if name in DISTILL_LOSSES:
        return DISTILL_LOSSES[name]
    close = difflib.get_close_matches(str(name), list(DISTILL_LOSSES), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"distill.loss must be one of {', '.join(map(repr, DISTILL_LOSSES))}; got {name!r}{hint}")


@register_distill_loss("reverse_kl", help="per-token reverse KL on the sampled tokens as a dense advantage")
def reverse_kl(old: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
    """A^d_t = -(log pi_old(y_t) - log pi_teacher(y_t)) on the sampled tokens y_t ~ pi_old.

    Its expectation over y_t is -KL(pi_old || pi_teacher)( . | y_<t), so a policy gradient with this
    advantage lowers the per-token reverse KL to the teacher (Agarwal et al. 2024, "On-policy
    distillation of language models"; Thinking Machines, "On-Policy Distillation", 2025; the Qwen3
    technical report's on-policy distillation stage; slime's and verl's OPD use the same advantage)."""
    return torch.where(mask, teacher - old, torch.zeros_like(old)).detach()


@register_distill_loss("topk_forward_kl", topk=True, help="forward KL to the teacher's top-k distribution")
def topk_forward_kl(student: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
    """D_t = sum_k q_k (log q_k - log pi(k)), q = softmax over the K of the teacher's top-k log-probs
    (renormalized), pi(k) the student's full-vocabulary probability of token k at t. Equal to
    KL(q || pi restricted and renormalized to the K) - log pi(K) >= 0: it matches the teacher's
    top-k distribution and moves the student's mass onto those tokens (the sparse forward KL of
    logit distillation; MiniLLM / GKD use the full-vocabulary form, Gemma 2 and slime's top-k
    distillation this one). Gradient: -sum_k q_k d log pi(k), a cross entropy to q."""
    q = torch.softmax(teacher.detach(), dim=-1)
    d = (q * (torch.log_softmax(teacher.detach(), dim=-1) - student)).sum(-1)
    return torch.where(mask, d, torch.zeros_like(d))


@register_distill_loss("topk_reverse_kl", topk=True, help="reverse KL over the teacher's top-k tokens")
def topk_reverse_kl(student: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
    """D_t = sum_k p_k (log p_k - log q_k) with p = softmax of the student's log-probs over the K
    tokens and q the teacher's, both renormalized over the teacher's top-k set: the mode-seeking
    reverse KL restricted to that set (it does not move mass onto the set)."""
    p_log = torch.log_softmax(student, dim=-1)
    d = (p_log.exp() * (p_log - torch.log_softmax(teacher.detach(), dim=-1))).sum(-1)
    return torch.where(mask, d, torch.zeros_like(d))


@dataclass(frozen=True)
class DistillTerm:
    """objective: the scalar J_token(A^d) of this rank's tokens (before the normalizer; maximized).
    reverse_kl_sum: sum over this rank's response tokens of old - teacher (the k1 estimate of the
    reverse KL, detached). cut_tok [N] bool: where the policy's clip cuts the distillation term's
    gradient off (the advantage objectives; None for the top-k divergences, which are not clipped)."""

    objective: Tensor
    reverse_kl_sum: Tensor
    cut_tok: Tensor | None = None


def distill_objective(
    spec: PolicyObjective,
    inputs: LossInputs,
    old: Tensor,
    teacher: Tensor,
    mask: Tensor,
    loss_name: str,
    clip_low: float,
    clip_high: float,
    topk: tuple[Tensor, Tensor] | None = None,
) -> DistillTerm:
    """J_token(A^d) under the policy mode ``spec``'s per-token form (module docstring), or for a top-k
    objective J = -sum_t tok_w_t D_t. ``old``, ``teacher`` [N] fp32, 0 off the response (``mask`` [N]
    bool); ``topk``: (student [N, K], teacher [N, K]) log-probs of the teacher's top-k tokens."""
    teacher = torch.where(mask, teacher.detach().to(old.dtype), torch.zeros_like(old))  # NaN padding cannot leak
    rkl = torch.where(mask, old - teacher, torch.zeros_like(old)).sum()
    objective = distill_loss(loss_name)
    if objective.topk:
        if topk is None:
            raise ValueError(f"distill.loss={loss_name!r} needs the teacher's top-k (distill.topk > 0)")
        student_k, teacher_k = topk
        safe = mask[:, None]  # off the response: zeros, so no NaN / inf reaches the softmax
        student_k = torch.where(safe, student_k.to(old.dtype), torch.zeros_like(student_k, dtype=old.dtype))
        teacher_k = torch.where(safe, teacher_k.to(old.dtype), torch.zeros_like(teacher_k, dtype=old.dtype))
        return DistillTerm(-(inputs.tok_w * objective.fn(student_k, teacher_k, mask)).sum(), rkl)
    adv = objective.fn(old, teacher, mask)
    token_form = POLICY_LOSSES["gspo_token"] if spec.sequence_ratio else spec
    terms: ObjectiveTerms = token_form.fn(replace(inputs, adv_seq=None, adv_tok=adv), clip_low, clip_high)
    return DistillTerm(terms.objective, rkl, terms.cut_tok)
