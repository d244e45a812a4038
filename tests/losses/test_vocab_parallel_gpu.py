"""On a GPU: the chunked log-prob + entropy at Qwen's vocab never holds [N, V] fp32 (peak allocated
memory bounded by the bf16 input gradient plus a few chunk temporaries) and matches log_softmax."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.losses import vocab_parallel_logprobs


@pytest.mark.gpu
def test_cuda_real_vocab_memory_bound_and_values():
    n, v, chunk = 4096, 151936, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, v, device="cuda", generator=g) * 3).bfloat16().requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = vocab_parallel_logprobs(logits, targets, temperature=0.7, chunk_size=chunk)
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    grad_bytes = n * v * logits.element_size()
    temporaries = 4 * chunk * v * 4  # at most a few [chunk, V] fp32 tensors alive at once
    assert peak <= grad_bytes + temporaries + 64 * 2**20, (peak, grad_bytes, temporaries)
    assert peak < n * v * 4  # less than one [N, V] fp32 tensor, gradient included

    rows = slice(0, 64)
    x = logits.detach()[rows].float().requires_grad_(True)
    logp = torch.log_softmax(x / 0.7, -1)
    ref_lp = logp.gather(1, targets[rows, None]).squeeze(1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(lp[rows], ref_lp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent[rows], ref_ent, rtol=1e-5, atol=1e-4)
    (ref_lp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(logits.grad[rows].float(), x.grad, rtol=2e-2, atol=1e-2)
