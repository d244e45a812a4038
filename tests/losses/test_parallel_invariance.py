"""TP1 vs TP2 and CP1 vs CP2 (2 gloo ranks): same loss and gradients for the full loss path
(vocab-parallel log-probs + entropy -> policy loss with KL, entropy bonus, TIS, and on-policy
distillation's sampled-token and top-k terms) in fp32."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from loss_workers import CASES, cp_worker, loss_from_logits, tp_padded_vocab_worker, tp_worker

SEQ_METRICS = (
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "approx_kl_old",
    "num_seqs",
    "num_tokens",
    "entropy",
    "kl_ref",
    "engine_logprob_absdiff",
    "tis_weight_mean",
)


def make_data(seed: int = 0, vocab: int = 24):
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 3, 9, 4, 6]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    n_tok = seq.numel()
    logits = torch.randn(n_tok, vocab, generator=g) * 2
    targets = torch.randint(0, vocab, (n_tok,), generator=g)
    true_lp = torch.log_softmax(logits.double() / 0.8, -1).gather(1, targets[:, None]).squeeze(1).float()
    mask = torch.ones(n_tok)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    mask[starts] = 0  # first token of each sequence is prompt
    mask[seq == 3] = 0  # a sequence without response tokens
    # a teacher: its sampled-token log-probs, and its top-4 ids (distinct; the sampled token among
    # them for some positions) with log-probs of a peaked distribution
    teacher_logits = logits + torch.randn(n_tok, vocab, generator=g)
    teacher_all = torch.log_softmax(teacher_logits.double(), -1).float()
    topk_teacher, topk_ids = teacher_all.topk(4, dim=-1)
    data = dict(
        teacher=teacher_all.gather(1, targets[:, None]).squeeze(1),
        topk_ids=topk_ids,
        topk_teacher=topk_teacher,
        targets=targets,
        old=true_lp + torch.randn(n_tok, generator=g) * 1e-2,
        ref=true_lp + torch.randn(n_tok, generator=g) * 0.2,
        engine=true_lp + torch.randn(n_tok, generator=g) * 0.1,
        adv=torch.randn(len(lengths), generator=g),
        mask=mask,
        seq=seq,
        num_seqs=len(lengths),
    )
    # Token owner for CP2: random, except sequence 2 lives on rank 0 only (rank 1 has none of it).
    owner = torch.randint(0, 2, (n_tok,), generator=g)
    owner[seq == 2] = 0
    return logits, data, owner


def reference():
    logits, data, _ = make_data()
    out = []
    for mode, options in CASES:
        x = logits.clone().requires_grad_(True)
        loss, metrics = loss_from_logits(x, data, mode, options)
        loss.backward()
        out.append((loss.detach(), metrics, x.grad))
    return out


@pytest.fixture(scope="module")
def ref_results():
    return reference()


def test_tp2_matches_tp1(ref_results):
    logits, data, _ = make_data()
    ranks = run_ranks(tp_worker, 2, logits, data)
    for c, (mode, options) in enumerate(CASES):
        ref_loss, ref_metrics, ref_grad = ref_results[c]
        assert ref_grad.abs().sum() > 0
        if options.get("reward_coef", 1.0):  # (distillation alone: no task advantage to clip)
            assert 0 < ref_metrics["clip_fraction"] < 1  # both clip branches are exercised
        if options.get("distill_coef"):  # the teacher's term is in the loss, not a no-op
            plain = loss_from_logits(logits.clone(), data, mode, {**options, "distill_coef": 0.0})[0]
            assert abs(float(plain) - float(ref_loss)) > 1e-3, (mode, options)
        for r in range(2):
            loss, metrics, _ = ranks[r][c]
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-8, msg=f"{mode} {options} rank {r}")
            for k in SEQ_METRICS:
                if k in ref_metrics:
                    assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-7), (mode, k)
        grad = torch.cat([ranks[0][c][2], ranks[1][c][2]], dim=1)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-8, msg=f"{mode} {options}")


def test_cp2_matches_cp1(ref_results):
    logits, data, owner = make_data()
    ranks = run_ranks(cp_worker, 2, logits, data, owner)
    for c, (mode, options) in enumerate(CASES):
        ref_loss, ref_metrics, ref_grad = ref_results[c]
        total = ranks[0][c][0] + ranks[1][c][0]
        torch.testing.assert_close(total, ref_loss, rtol=1e-6, atol=1e-8, msg=f"{mode} {options}")
        grad = torch.zeros_like(ref_grad)
        for r in range(2):
            _, metrics, g, idx = ranks[r][c]
            grad[idx] = g
            for k in SEQ_METRICS:  # per-sequence statistics are exact on every CP rank
                if k in ref_metrics and not (mode == "grpo" and k == "tis_weight_mean"):
                    assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-7), (mode, k)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-8, msg=f"{mode} {options}")
        # Each rank's share is a real part of the loss, not a replica.
        assert not torch.allclose(ranks[0][c][0], ref_loss)


def test_tp2_padded_vocab():
    """Megatron's vocab padding: rank 1 holds some padding (vocab 20 of 24) or only padding (10 of 24)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 24, generator=g, dtype=torch.float64)
    weights = torch.randn(9, generator=g, dtype=torch.float64)
    cases = [(v, torch.randint(0, v, (9,), generator=g)) for v in (20, 10)]
    ranks = run_ranks(tp_padded_vocab_worker, 2, logits, cases, weights)
    for c, (vocab_size, targets) in enumerate(cases):
        x = logits.clone().requires_grad_(True)
        logp = torch.log_softmax(x[:, :vocab_size], -1)
        ref_lp, ref_ent = logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)
        ((ref_lp * weights).sum() + (ref_ent * weights.flip(0)).sum()).backward()
        for r in range(2):
            lp, ent, _ = ranks[r][c]
            torch.testing.assert_close(lp, ref_lp.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(ent, ref_ent.detach(), rtol=1e-12, atol=1e-12)
        grad = torch.cat([ranks[0][c][2], ranks[1][c][2]], dim=1)
        torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-12)
        assert grad[:, vocab_size:].abs().sum() == 0
