"""On a GPU: the fused log-prob head at Qwen's vocab holds no [N, V] tensor (peak allocated memory is
bounded by a few chunk temporaries, the fp32 grad_W accumulator and the gradients, and does not grow
with N beyond the [N, H] terms) and matches log_softmax of the full logits in value and gradient."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.losses.fused_logprobs import fused_vocab_parallel_logprobs


def _peak(n, v, h, chunk):
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = (torch.randn(n, h, device="cuda", generator=g) / h**0.25).bfloat16().requires_grad_(True)
    w = (torch.randn(v, h, device="cuda", generator=g) * 3 / h**0.25).bfloat16().requires_grad_(True)
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = fused_vocab_parallel_logprobs(hid, w, targets, temperature=0.7, chunk_size=chunk)
    (lp.sum() + ent.sum()).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, hid, w, targets, lp, ent


@pytest.mark.gpu
def test_cuda_real_vocab_memory_bound_and_values():
    v, h, chunk = 151936, 1024, 256
    temporaries = 6 * chunk * v * 4 + v * h * (4 + 2)  # chunk fp32/bf16 temporaries, grad_W fp32 + bf16
    peaks = {}
    for n in (2048, 8192):
        peak, hid, w, targets, lp, ent = _peak(n, v, h, chunk)
        peaks[n] = peak
        assert peak <= temporaries + n * h * 2 * 2 + 64 * 2**20, (n, peak, temporaries)
    # no [N, V] tensor: from 2048 to 8192 tokens the peak grows by the [N, H] terms only (hidden and its
    # gradient, bf16), not by the 6144 x V logits. (At 2048 tokens the absolute peak is above the bf16
    # logits: the chunk temporaries and grad_W, both N-independent, are larger -- seen on an H200.)
    assert peaks[8192] - peaks[2048] <= 6144 * h * 2 * 2 + 64 * 2**20, peaks
    assert peaks[8192] < 8192 * v * 2  # less than the bf16 logits alone once N is large
    rows = slice(0, 64)
    x = hid.detach()[rows].float().requires_grad_(True)
    wf = w.detach().float().requires_grad_(True)
    logp = torch.log_softmax((x.bfloat16() @ wf.bfloat16().t()).float() / 0.7, -1)
    ref_lp = logp.gather(1, targets[rows, None]).squeeze(1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(lp[rows], ref_lp, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(ent[rows], ref_ent, rtol=1e-4, atol=1e-3)
    # gradient of the first 64 tokens' loss in h: the fused backward on those rows alone
    h64 = hid.detach()[rows].clone().requires_grad_(True)
    lp64, ent64 = fused_vocab_parallel_logprobs(h64, w.detach(), targets[rows], temperature=0.7, chunk_size=16)
    (lp64.sum() + ent64.sum()).backward()
    (ref_lp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(h64.grad.float(), x.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.gpu
def test_cuda_compiled_kernels_are_the_default_and_equal_eager():
    """On a GPU with Triton the head runs its per-chunk arithmetic compiled (kernels="auto"), and that
    gives the eager head's log-probs, entropies and gradients (bf16 GEMMs, fp32 softmax math)."""
    from torch.utils._triton import has_triton

    from gspo_megatron.losses.chunk_kernels import chunk_ops

    assert has_triton(), "a CUDA torch ships Triton: the compiled head is the GPU default"
    assert chunk_ops(torch.device("cuda"), "auto").form == "compiled"
    v, h, n = 151936, 1024, 1000
    g = torch.Generator(device="cuda").manual_seed(1)
    hid = (torch.randn(n, h, device="cuda", generator=g) / h**0.25).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) * 3 / h**0.25).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    wl = torch.randn(n, device="cuda", generator=g)
    outs = {}
    for kernels in ("eager", "auto"):
        x, wk = hid.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, ent = fused_vocab_parallel_logprobs(x, wk, targets, temperature=0.7, chunk_size=300, kernels=kernels)
        ((lp * wl).sum() + (ent * wl.flip(0)).sum()).backward()
        outs[kernels] = (lp.detach(), ent.detach(), x.grad.float(), wk.grad.float())
    (lp_e, ent_e, gh_e, gw_e), (lp_c, ent_c, gh_c, gw_c) = outs["eager"], outs["auto"]
    torch.testing.assert_close(lp_c, lp_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_c, ent_e, rtol=1e-5, atol=1e-5)
    for a, b in ((gh_c, gh_e), (gw_c, gw_e)):  # bf16 gradients: equal but for bf16 rounding of g
        assert ((a - b).norm() / b.norm()).item() < 1e-2
