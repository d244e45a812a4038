"""Fused output layer + vocab-parallel log-probs / entropy: values against log_softmax of the full
logits, float64 gradcheck (finite differences) in hidden states and weight, gradients equal to the
unfused path, padded vocab, and TP2 (2 gloo ranks, vocab shards of the weight, hidden states routed
through Megatron's copy-to-TP region) equal to TP1."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.losses import vocab_parallel_logprobs
from gspo_megatron.losses.fused_logprobs import fused_vocab_parallel_logprobs


def reference(hidden, weight, targets, temperature, vocab_size=None):
    logits = hidden.double() @ weight.double().t()
    if vocab_size is not None:
        logits = logits[..., :vocab_size]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    valid = (targets >= 0) & (targets < logp.shape[-1])
    lp = logp.gather(-1, targets.clamp(0, logp.shape[-1] - 1)[..., None]).squeeze(-1)
    return torch.where(valid, lp, torch.zeros_like(lp)), -(logp.exp() * logp).sum(-1)


def make(seed, n=23, h=8, v=37, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype) * 1.5
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [1, 5, 64, None])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_match_full_log_softmax(chunk_size, temperature):
    hidden, weight, targets = make(0)
    lp, ent = fused_vocab_parallel_logprobs(
        hidden.view(1, 23, 8), weight, targets.view(1, 23), temperature=temperature, chunk_size=chunk_size
    )
    ref_lp, ref_ent = reference(hidden, weight, targets, temperature)
    assert lp.shape == (1, 23) and lp.dtype == torch.float32
    torch.testing.assert_close(lp[0].double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[0].double(), ref_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_gradcheck_float64_hidden_and_weight(chunk_size):
    hidden, weight, targets = make(1, n=9, h=5, v=11, dtype=torch.float64)
    targets[3] = -100  # ignored: log-prob 0, no gradient from it
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def fn(h, w):
        return fused_vocab_parallel_logprobs(h, w, targets, temperature=0.7, chunk_size=chunk_size)

    assert torch.autograd.gradcheck(lambda h, w: fn(h, w)[0], (hidden, weight))
    assert torch.autograd.gradcheck(lambda h, w: fn(h, w)[1], (hidden, weight))
    assert torch.autograd.gradcheck(fn, (hidden, weight))  # both outputs, independent upstream grads
    assert fn(hidden, weight)[0][3].item() == 0.0


def test_padded_vocab_gradcheck_and_values():
    hidden, weight, targets = make(4, n=6, h=4, v=12, dtype=torch.float64)
    targets = targets % 9
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    fn = lambda h, w: fused_vocab_parallel_logprobs(h, w, targets, vocab_size=9, chunk_size=2)
    assert torch.autograd.gradcheck(fn, (hidden, weight))
    lp, ent = fn(hidden, weight)
    ref_lp, ref_ent = reference(hidden.detach(), weight.detach(), targets, 1.0, vocab_size=9)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    (lp.sum() + ent.sum()).backward()
    assert weight.grad[9:].abs().max().item() == 0.0  # padded rows: zero gradient


def test_value_and_gradient_equal_unfused_path_and_autograd():
    """The same loss through (a) the fused function, (b) logits = h @ W^T then the chunked path,
    (c) plain autograd of log_softmax, in float64: equal values and gradients in h and W."""
    hidden, weight, targets = make(2, n=31, h=6, v=29, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    wl, we = torch.randn(31, generator=g, dtype=torch.float64), torch.randn(31, generator=g, dtype=torch.float64)
    results = []
    for path in ("fused", "chunked", "autograd"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if path == "fused":
            lp, ent = fused_vocab_parallel_logprobs(h, w, targets, temperature=0.8, chunk_size=7)
        elif path == "chunked":
            lp, ent = vocab_parallel_logprobs(h @ w.t(), targets, temperature=0.8, chunk_size=7)
        else:
            logp = torch.log_softmax((h @ w.t()) / 0.8, -1)
            lp, ent = logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)
        ((lp * wl).sum() + (ent * we).sum()).backward()
        results.append((lp.detach(), ent.detach(), h.grad, w.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_logprob_only_and_no_grad():
    hidden, weight, targets = make(5)
    h = hidden.clone().requires_grad_(True)
    lp, ent = fused_vocab_parallel_logprobs(h, weight, targets, with_entropy=False)
    assert ent is None
    lp.sum().backward()
    x = hidden.clone().requires_grad_(True)
    torch.log_softmax(x @ weight.t(), -1).gather(1, targets[:, None]).sum().backward()
    torch.testing.assert_close(h.grad, x.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        lp2, _ = fused_vocab_parallel_logprobs(hidden, weight, targets, with_entropy=False)
    torch.testing.assert_close(lp2, lp.detach())


def test_bf16_weight_fp32_softmax():
    hidden, weight, targets = make(6, n=40, h=16, v=300)
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    lp, ent = fused_vocab_parallel_logprobs(hb, wb, targets, chunk_size=16)
    assert lp.dtype == torch.float32
    logits = (hb @ wb.t()).float()  # the bf16 GEMM's output, then fp32 math: the unfused path
    ref_lp, ref_ent = vocab_parallel_logprobs(logits, targets)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)


def test_bad_input_names_the_shapes():
    hidden, weight, targets = make(7)
    with pytest.raises(ValueError, match="weight"):
        fused_vocab_parallel_logprobs(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="targets"):
        fused_vocab_parallel_logprobs(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="temperature"):
        fused_vocab_parallel_logprobs(hidden, weight, targets, temperature=0.0)


def _tp_worker(rank, world, hidden, weight, targets, vocab_size, wl, we):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    dist.init_process_group("gloo", rank=rank, world_size=world)
    v_local = weight.shape[0] // world
    h = hidden.clone().requires_grad_(True)
    w = weight[rank * v_local : (rank + 1) * v_local].clone().requires_grad_(True)
    # as in the model path: the hidden states enter the TP region (backward: all-reduce over TP)
    lp, ent = fused_vocab_parallel_logprobs(
        copy_to_tensor_model_parallel_region(h, group=dist.group.WORLD),
        w,
        targets,
        tp_group=dist.group.WORLD,
        temperature=0.8,
        chunk_size=3,
        vocab_size=vocab_size,
    )
    ((lp * wl).sum() + (ent * we).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("vocab_size", [None, 30, 19])  # 19: rank 1's shard is all padding
def test_tp2_matches_tp1(vocab_size):
    hidden, weight, targets = make(8, n=13, h=6, v=38)
    if vocab_size is not None:
        targets = targets % vocab_size
    targets[2] = -100
    g = torch.Generator().manual_seed(9)
    wl, we = torch.randn(13, generator=g), torch.randn(13, generator=g)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp1, ent1 = fused_vocab_parallel_logprobs(h1, w1, targets, temperature=0.8, chunk_size=3, vocab_size=vocab_size)
    ((lp1 * wl).sum() + (ent1 * we).sum()).backward()
    ref_lp, ref_ent = reference(hidden, weight, targets, 0.8, vocab_size)
    torch.testing.assert_close(lp1.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent1.double(), ref_ent, rtol=1e-5, atol=1e-5)
    out = run_ranks(_tp_worker, 2, hidden, weight, targets, vocab_size, wl, we, timeout=300)
    for rank, (lp, ent, hg, wg) in enumerate(out):
        torch.testing.assert_close(lp, lp1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent, ent1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hg, h1.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(wg, w1.grad[rank * 19 : (rank + 1) * 19], rtol=1e-5, atol=1e-5)
