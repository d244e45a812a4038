"""K targets per token in one log-prob pass (``targets`` [..., K]; what the top-k distillation
objectives score: the teacher's top-k ids), from logits (``vocab_parallel_logprobs``) and from hidden
states (``fused_vocab_parallel_logprobs``): values and gradients equal K separate one-target passes
(float64, with duplicate ids, ignored ids and a padded vocabulary), K = 1 is the one-target path
bitwise, and the fused form matches on two tensor-parallel ranks (tests/losses/test_fused_logprobs.py's
worker)."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.losses import vocab_parallel_logprobs
from gspo_megatron.losses.fused_logprobs import fused_vocab_parallel_logprobs
from test_fused_logprobs import _tp_worker

N, H, V, K = 11, 6, 29, 4


def _inputs(seed: int, vocab_size: int | None):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 1.3
    real = vocab_size or V
    ids = torch.randint(0, real, (N, K), generator=g)
    ids[2, 1] = ids[2, 0]  # the same id twice
    ids[4, 3] = -100  # ignored
    ids[6, 2] = real + 1 if vocab_size else -5  # outside the real vocabulary
    wl = torch.randn(N, K, generator=g, dtype=torch.float64)
    we = torch.randn(N, generator=g, dtype=torch.float64)
    return hidden, weight, ids, wl, we


def _run(path: str, hidden, weight, ids, wl, we, vocab_size, per_k: bool):
    """(log-probs [N, K], entropy, the gradients) of sum wl * logp + sum we * entropy: all K in one
    call, or (per_k) one call per column (the entropy term once)."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = h @ w.t() if path == "logits" else None

    def call(t):
        kw = dict(temperature=0.7, chunk_size=3, vocab_size=vocab_size)
        if path == "logits":
            return vocab_parallel_logprobs(logits, t, **kw)
        return fused_vocab_parallel_logprobs(h, w, t, **kw)

    if per_k:
        outs = [call(ids[:, k]) for k in range(K)]
        lp, ent = torch.stack([o[0] for o in outs], dim=-1), outs[0][1]
    else:
        lp, ent = call(ids)
    ((lp * wl).sum() + (ent * we).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("path", ["logits", "fused"])
@pytest.mark.parametrize("vocab_size", [None, 23])
def test_k_targets_in_one_pass_equal_k_passes(path, vocab_size):
    hidden, weight, ids, wl, we = _inputs(0, vocab_size)
    one = _run(path, hidden, weight, ids, wl, we, vocab_size, per_k=False)
    sep = _run(path, hidden, weight, ids, wl, we, vocab_size, per_k=True)
    assert one[0].shape == (N, K)
    for a, b in zip(one, sep):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert one[0][4, 3] == 0 and one[0][6, 2] == 0 and one[0][2, 1] == one[0][2, 0]
    # against log_softmax of the full logits
    logits = (hidden @ weight.t())[:, : vocab_size or V] / 0.7
    ref = torch.log_softmax(logits, -1).gather(1, ids.clamp(0, (vocab_size or V) - 1))
    valid = (ids >= 0) & (ids < (vocab_size or V))
    torch.testing.assert_close(one[0], torch.where(valid, ref, torch.zeros_like(ref)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", ["logits", "fused"])
def test_one_target_as_a_column_is_the_one_target_path_bitwise(path):
    hidden, weight, ids, wl, we = _inputs(1, None)
    hidden, weight = hidden.float(), weight.float()
    t = ids[:, 0].clamp(min=0)
    col = _run(path, hidden, weight, t[:, None], wl[:, :1].float(), we.float(), None, per_k=False)
    flat = _run(path, hidden, weight, t, wl[:, 0].float(), we.float(), None, per_k=False)
    assert torch.equal(col[0][:, 0], flat[0]) and all(torch.equal(a, b) for a, b in zip(col[1:], flat[1:]))


@pytest.mark.parametrize("path", ["logits", "fused"])
def test_gradcheck_k_targets(path):
    hidden, weight, ids, _, _ = _inputs(2, None)
    h, w = hidden[:5].clone().requires_grad_(True), weight.clone().requires_grad_(True)
    t = ids[:5]

    def fn(h_, w_):
        if path == "logits":
            return vocab_parallel_logprobs(h_ @ w_.t(), t, temperature=0.9, chunk_size=2)
        return fused_vocab_parallel_logprobs(h_, w_, t, temperature=0.9, chunk_size=2)

    assert torch.autograd.gradcheck(fn, (h, w))


def test_k_targets_fused_on_two_tp_ranks():
    hidden, weight, ids, wl, we = _inputs(3, None)
    hidden, weight, wl, we = hidden.float(), weight[:28].float(), wl.float(), we.float()  # 28 rows: 14 per rank
    ids = ids % 28
    ids[4, 3] = -100
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp1, ent1 = fused_vocab_parallel_logprobs(h1, w1, ids, temperature=0.8, chunk_size=3)
    ((lp1 * wl).sum() + (ent1 * we).sum()).backward()
    out = run_ranks(_tp_worker, 2, hidden, weight, ids, None, wl, we, timeout=300)
    for rank, (lp, ent, hg, wg) in enumerate(out):
        torch.testing.assert_close(lp, lp1.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ent1.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hg, h1.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(wg, w1.grad[rank * 14 : (rank + 1) * 14], rtol=1e-5, atol=1e-5)
