"""On-policy distillation's loss term (``losses/distill_loss.py``) against a hand computation, one
scalar at a time: J = J_policy(reward_coef * A) + coef * sum_i (1/|y_i|) sum_t min(s_it A^d_t,
clip(s_it) A^d_t) with A^d_t = teacher_t - old_t and, for gspo, GSPO-token's s_it = sg[s_i] pi_t /
sg[pi_t] (value s_i); coef 0 is the policy loss bitwise (loss and gradient), teacher or not."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.losses.distill_loss import distill_loss, distill_loss_names, register_distill_loss
from gspo_megatron.losses.policy_loss import PolicyLossConfig, policy_loss, policy_loss_flat

CLIP = (0.2, 0.3)


def _batch():
    """3 sequences x 5 positions, float64, with a teacher that disagrees by up to ~1 nat."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.float64)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64) - 0.5
    teacher = old + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.7
    teacher = torch.where(mask > 0, teacher, torch.full_like(teacher, float("nan")))  # padding must not leak
    lp = (old + 0.05 * torch.randn(3, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    return lp, old, teacher, adv, mask


def _hand(lp, old, teacher, adv, mask, mode, coef, reward_coef):
    x = lp.detach().clone().requires_grad_(True)
    total = 0.0
    for i in range(3):
        toks = [t for t in range(5) if mask[i, t] > 0]
        n = len(toks)
        a = reward_coef * adv[i]
        if mode == "gspo":
            log_s = sum(x[i, t] - old[i, t] for t in toks) / n
            s = torch.exp(log_s)
            total = total + torch.minimum(s * a, s.clamp(1 - CLIP[0], 1 + CLIP[1]) * a)
        for t in toks:
            ad = float(teacher[i, t] - old[i, t])
            if mode == "gspo":
                r = torch.exp(log_s.detach() + x[i, t] - x[i, t].detach())
            else:
                r = torch.exp(x[i, t] - old[i, t])
                total = total + torch.minimum(r * a, r.clamp(1 - CLIP[0], 1 + CLIP[1]) * a) / n
            total = total + coef * torch.minimum(r * ad, r.clamp(1 - CLIP[0], 1 + CLIP[1]) * ad) / n
    loss = -total / 3
    loss.backward()
    return loss.detach(), x.grad


def _ours(lp, old, teacher, adv, mask, mode, coef, reward_coef, with_teacher=True):
    x = lp.detach().clone().requires_grad_(True)
    loss, metrics = policy_loss(
        x,
        old,
        adv,
        mask,
        mode=mode,
        clip_low=CLIP[0],
        clip_high=CLIP[1],
        teacher_logprobs=teacher if with_teacher else None,
        distill_coef=coef,
        reward_coef=reward_coef,
    )
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("mode", ["gspo", "grpo"])
@pytest.mark.parametrize("coef, reward_coef", [(1.0, 1.0), (0.5, 0.0), (2.0, 0.3)])
def test_the_distillation_term_matches_the_hand_computation(mode, coef, reward_coef):
    lp, old, teacher, adv, mask = _batch()
    want_loss, want_grad = _hand(lp, old, teacher, adv, mask, mode, coef, reward_coef)
    loss, grad, metrics = _ours(lp, old, teacher, adv, mask, mode, coef, reward_coef)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    m = mask > 0
    assert metrics["distill_reverse_kl"] == pytest.approx(
        float((old - teacher)[m].mean()), rel=1e-6
    )  # metrics are fp32


@pytest.mark.parametrize("mode", ["gspo", "grpo"])
def test_the_distillation_clip_fraction_counts_the_tokens_the_clip_cuts(mode):
    """``distill_clip_fraction``: response tokens t whose ratio (gspo: the sequence's s_i, the value
    of GSPO-token's s_it; grpo: r_t) is beyond the clip on the side its advantage A^d_t pushes to."""
    lp, old, teacher, adv, mask = _batch()
    g = torch.Generator().manual_seed(5)
    shift = torch.tensor([[0.5], [-0.5], [0.1]], dtype=torch.float64)  # sequences beyond either clip edge
    lp = (old + shift + 0.4 * torch.randn(3, 5, generator=g, dtype=torch.float64)).requires_grad_(True)
    *_, metrics = _ours(lp, old, teacher, adv, mask, mode, 1.0, 1.0)
    m = mask > 0
    delta = torch.where(m, lp.detach() - old, torch.zeros_like(old))
    ratio = (
        torch.exp(delta.sum(1, keepdim=True) / m.sum(1, keepdim=True)).expand(3, 5) if mode == "gspo" else delta.exp()
    )
    ad = torch.where(m, teacher - old, torch.zeros_like(old))
    cut = ((ad > 0) & (ratio > 1 + CLIP[1])) | ((ad < 0) & (ratio < 1 - CLIP[0]))
    want = float(cut[m].double().mean())
    assert 0 < want < 1  # both kinds of token are in the batch
    assert metrics["distill_clip_fraction"] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("mode", ["gspo", "gspo_token", "grpo"])
def test_coef_zero_is_the_policy_loss_bitwise(mode):
    """distill.coef = 0: with or without the teacher's log-probs, the loss and its gradient are the
    policy loss's exactly, and no distillation metric appears."""
    lp, old, teacher, adv, mask = _batch()
    a = _ours(lp, old, teacher, adv, mask, mode, 0.0, 1.0, with_teacher=True)
    b = _ours(lp, old, teacher, adv, mask, mode, 0.0, 1.0, with_teacher=False)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert "distill_reverse_kl" not in a[2] and "distill_clip_fraction" not in a[2]


def test_on_policy_gradient_is_the_dense_advantage():
    """At lp == old (ratio 1, no clip) and reward_coef 0, d loss / d lp_t = -coef A^d_t / (|y_i| S):
    each sampled token is pushed by how much more the teacher likes it than the student."""
    lp, old, teacher, adv, mask = _batch()
    lp = old.clone().requires_grad_(True)
    _, grad, _ = _ours(lp, old, teacher, adv, mask, "gspo", 1.5, 0.0)
    n = mask.sum(1, keepdim=True)
    want = torch.where(mask > 0, -1.5 * (teacher - old) / (n * 3), torch.zeros_like(old))
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-14)


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match="distill.loss must be one of 'reverse_kl'"):
        PolicyLossConfig(distill_loss="forward_kl")
    with pytest.raises(ValueError, match="distill_coef must be a finite value >= 0"):
        PolicyLossConfig(distill_coef=-1.0)
    lp, old, teacher, adv, mask = _batch()
    with pytest.raises(ValueError, match="distill_coef != 0 needs teacher_logprobs"):
        _ours(lp, old, teacher, adv, mask, "gspo", 1.0, 1.0, with_teacher=False)
    bad = teacher.clone()
    bad[1, 2] = float("inf")
    with pytest.raises(ValueError, match="teacher_logprobs"):
        _ours(lp, old, bad, adv, mask, "gspo", 1.0, 1.0)


def test_a_registered_objective_is_used_by_name():
    name = "test_half_reverse_kl"
    if name not in distill_loss_names():

        @register_distill_loss(name, help="half of reverse_kl's advantage")
        def half(old, teacher, mask):
            return 0.5 * distill_loss("reverse_kl").fn(old, teacher, mask)

    lp, old, teacher, adv, mask = _batch()
    x = lp.detach().clone().requires_grad_(True)
    policy_loss(
        x, old, adv, mask, mode="grpo", teacher_logprobs=teacher, distill_coef=1.0, reward_coef=0.0, distill_loss=name
    ).loss.backward()
    y = lp.detach().clone().requires_grad_(True)
    policy_loss(
        y, old, adv, mask, mode="grpo", teacher_logprobs=teacher, distill_coef=0.5, reward_coef=0.0
    ).loss.backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)


def _topk_batch(K=3, V=11):
    """Student logits [3, 5, V] (log-probs of the teacher's top-k ids gathered from them) and a
    teacher's top-k log-probs; float64."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, V, generator=g, dtype=torch.float64, requires_grad=True)
    t_logits = torch.randn(3, 5, V, generator=g, dtype=torch.float64) * 2
    t_lp = torch.log_softmax(t_logits, -1)
    t_top, ids = t_lp.topk(K, dim=-1)
    return logits, ids, t_top


@pytest.mark.parametrize("name", ["topk_forward_kl", "topk_reverse_kl"])
def test_topk_objectives_match_the_hand_computation(name):
    """loss = coef * (1/S) sum_i (1/|y_i|) sum_t D_t (reward_coef 0): D from the renormalized top-k
    distributions, the student's log-probs of the K ids from its full-vocabulary log_softmax."""
    lp, old, teacher, adv, mask = _batch()
    logits, ids, t_top = _topk_batch()
    s_lp = torch.log_softmax(logits, -1)
    student_k = s_lp.gather(-1, ids)
    want = 0.0
    for i in range(3):
        toks = [t for t in range(5) if mask[i, t] > 0]
        for t in toks:
            q = torch.softmax(t_top[i, t], -1)
            if name == "topk_forward_kl":
                d = (q * (torch.log(q) - student_k[i, t])).sum()
            else:
                p = torch.softmax(student_k[i, t], -1)
                d = (p * (torch.log(p) - torch.log(q))).sum()
            want = want + 0.7 * d / len(toks)
    want = want / 3
    (g_want,) = torch.autograd.grad(want, logits, retain_graph=True)
    x = old.clone().requires_grad_(True)  # reward_coef 0: the policy term is 0

    cfg = PolicyLossConfig(mode="gspo", distill_coef=0.7, reward_coef=0.0, distill_loss=name)
    seq = torch.arange(3).repeat_interleave(5)
    loss, _ = policy_loss_flat(
        x.reshape(-1),
        old.reshape(-1),
        adv,
        mask.reshape(-1),
        seq,
        3,
        cfg,
        teacher_logprobs=torch.nan_to_num(teacher).reshape(-1),
        topk_logprobs=(student_k.reshape(15, -1), t_top.reshape(15, -1)),
    )
    (g,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_want, rtol=1e-10, atol=1e-13)


def test_a_topk_objective_without_the_teachers_topk_is_refused():
    lp, old, teacher, adv, mask = _batch()
    with pytest.raises(ValueError, match="needs the teacher's top-k"):
        policy_loss(
            lp,
            old,
            adv,
            mask,
            teacher_logprobs=torch.nan_to_num(teacher),
            distill_coef=1.0,
            distill_loss="topk_forward_kl",
        )


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused_head"])
def test_the_megatron_loss_scores_the_teachers_topk_with_the_student_head(fused):
    """make_megatron_loss_func with the teacher's top-k in the micro-batch: the student's log-probs of
    the K ids come from its own head (logits, or hidden states and the output weight), the padded
    vocabulary rows (id >= vocab_size) weigh nothing, and the loss equals policy_loss_flat's on the
    same inputs."""
    from gspo_megatron.losses.megatron_loss import make_megatron_loss_func

    g = torch.Generator().manual_seed(3)
    b, s, H, V, vocab, K = 2, 6, 5, 13, 11, 4
    hidden = torch.randn(b, s, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]], dtype=torch.float64)
    ids = torch.randint(0, V, (b, s, K), generator=g)  # some >= vocab: padded rows
    ids[0, 2, 0] = V - 1
    t_lp = torch.log_softmax(torch.randn(b, s, K, generator=g, dtype=torch.float64), -1)
    old = -torch.rand(b, s, generator=g, dtype=torch.float64)
    batch = {
        "labels": labels,
        "loss_mask": mask,
        "old_logprobs": old,
        "seq_index": torch.arange(b)[:, None].expand(b, s).contiguous(),
        "advantages": torch.tensor([0.5, -1.0], dtype=torch.float64),
        "normalizer": 2.0,
        "teacher_logprobs": old - 0.3,
        "teacher_topk_ids": ids,
        "teacher_topk_logprobs": t_lp,
    }
    cfg = PolicyLossConfig(mode="gspo", distill_coef=0.5, distill_loss="topk_forward_kl")
    f = make_megatron_loss_func(
        batch, cfg, tp_group=None, cp_group=None, num_microbatches=1, data_parallel_size=1, vocab_size=vocab
    )
    logits = hidden @ weight.T
    loss, _ = f(hidden, output_weight=weight) if fused else f(logits)
    # reference: full log_softmax over the real vocabulary, the padded ids dropped from the teacher's top-k
    full = torch.log_softmax(logits[..., :vocab], -1)
    lp = full.gather(-1, labels[..., None])[..., 0]
    outside = ids >= vocab
    student_k = full.gather(-1, torch.where(outside, 0, ids))
    teacher_k = torch.where(outside, torch.full_like(t_lp, -1e4), t_lp)
    want, _ = policy_loss_flat(
        lp.reshape(-1),
        old.reshape(-1),
        batch["advantages"],
        mask.reshape(-1),
        batch["seq_index"].reshape(-1),
        b,
        cfg,
        teacher_logprobs=(old - 0.3).reshape(-1),
        topk_logprobs=(student_k.reshape(-1, K), teacher_k.reshape(-1, K)),
        normalizer=2.0,
    )
    torch.testing.assert_close(loss, want, rtol=1e-9, atol=1e-10)
    (g1,) = torch.autograd.grad(loss, weight, retain_graph=True)
    (g2,) = torch.autograd.grad(want, weight)
    torch.testing.assert_close(g1, g2, rtol=1e-8, atol=1e-10)
