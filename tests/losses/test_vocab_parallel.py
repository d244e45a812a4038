"""Chunked vocab-parallel log-probs and entropy: values against log_softmax, float64 finite differences."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.losses import vocab_parallel_logprobs


def reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, 64, None])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_match_log_softmax(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, 37, generator=g) * 4
    targets = torch.randint(0, 37, (2, 9), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, targets, temperature=temperature, chunk_size=chunk_size)
    ref_lp, ref_ent = reference(logits, targets, temperature)
    assert lp.shape == (2, 9) and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_finite_difference_gradients_float64(chunk_size):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(11, 13, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    targets = torch.randint(0, 13, (11,), generator=g)
    targets[3] = -100  # outside the vocab: finite log-prob, gradient of -log Z only

    def fn(x):
        return vocab_parallel_logprobs(x, targets, temperature=0.7, chunk_size=chunk_size)

    assert torch.autograd.gradcheck(lambda x: fn(x)[0], (logits,))
    assert torch.autograd.gradcheck(lambda x: fn(x)[1], (logits,))
    assert torch.autograd.gradcheck(fn, (logits,))  # both outputs with independent upstream grads
    assert fn(logits)[0][3].item() == 0.0  # an ignored target has log-prob 0


def test_padded_vocab_finite_differences_and_values():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 12, generator=g, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, 9, (5,), generator=g)
    fn = lambda x: vocab_parallel_logprobs(x, targets, vocab_size=9, chunk_size=2)
    assert torch.autograd.gradcheck(fn, (logits,))
    lp, ent = fn(logits)
    ref_lp, ref_ent = reference(logits.detach()[:, :9], targets, 1.0)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)


def test_gradient_matches_autograd_of_log_softmax():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(20, 50, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 50, (20,), generator=g)
    w_lp, w_ent = torch.randn(20, generator=g, dtype=torch.float64), torch.randn(20, generator=g, dtype=torch.float64)
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(x, targets, temperature=1.3, chunk_size=7)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    y = logits.clone().requires_grad_(True)
    ref_lp, ref_ent = reference(y, targets, 1.3)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-12)


def test_bf16_logits_fp32_math_and_no_entropy():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 31, generator=g) * 3).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 31, (6,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, targets, with_entropy=False, chunk_size=4)
    assert ent is None and lp.dtype == torch.float32
    ref_lp, _ = reference(logits.detach().float(), targets, 1.0)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-6, atol=1e-5)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = torch.nn.functional.one_hot(targets, 31) - torch.softmax(logits.detach().float(), -1)
    torch.testing.assert_close(logits.grad.float(), ref, rtol=1e-2, atol=1e-2)


def test_large_logits_stable():
    logits = torch.tensor([[1e4, 0.0, -1e4], [3e4, 3e4, 3e4]])
    lp, ent = vocab_parallel_logprobs(logits, torch.tensor([1, 2]))
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp[1], torch.tensor(-1.0986123), rtol=1e-6, atol=1e-6)
