"""The fused head's per-chunk kernels compiled by torch.compile (here Inductor's C++ backend; on a GPU
its Triton backend, tests/losses/test_fused_logprobs_gpu.py) equal the eager ones: log-probs,
entropies and both gradients, for fp32 / bf16 / fp64 weights, K = 1 and K = 3 targets with ignored
and padded-vocab ones, each gradient alone and both, uneven last chunks; a float64 gradcheck through
the compiled kernels; the choice of form and the eager fallback when compiling fails."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.exc import TorchDynamoException

from gspo_megatron.losses import chunk_kernels
from gspo_megatron.losses.chunk_kernels import EAGER, chunk_ops
from gspo_megatron.losses.fused_logprobs import fused_vocab_parallel_logprobs


def _inputs(dtype, n=29, h=16, v=53, k=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) / h**0.25).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 2 / h**0.25).to(dtype)
    targets = torch.randint(0, v, (n, k) if k > 1 else (n,), generator=g)
    targets.view(-1)[3] = -100  # ignored
    targets.view(-1)[7] = v - 1  # in the padded vocab below: ignored too
    return hidden, weight, targets


def _run(kernels, hidden, weight, targets, *, entropy_grad=True, logprob_grad=True, **kw):
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp, ent = fused_vocab_parallel_logprobs(h, w, targets, kernels=kernels, **kw)
    g = torch.Generator().manual_seed(1)
    loss = 0.0
    if logprob_grad:
        loss = loss + (lp * torch.randn(lp.shape, generator=g)).sum()
    if entropy_grad:
        loss = loss + (ent * torch.randn(ent.shape, generator=g)).sum()
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize(
    "dtype,k,grads",
    [
        (torch.float32, 1, "both"),
        (torch.float32, 3, "both"),
        (torch.float32, 1, "logprobs"),
        (torch.float32, 3, "entropy"),
        (torch.bfloat16, 1, "both"),
        (torch.bfloat16, 3, "logprobs"),
    ],
)
def test_compiled_equals_eager(dtype, k, grads):
    hidden, weight, targets = _inputs(dtype, k=k)
    kw = dict(
        temperature=0.7,
        chunk_size=6,  # 29 tokens: four chunks of 6 and one of 5
        vocab_size=weight.shape[0] - 2,
        entropy_grad=grads != "logprobs",
        logprob_grad=grads != "entropy",
    )
    eager = _run("eager", hidden, weight, targets, **kw)
    compiled = _run("compiled", hidden, weight, targets, **kw)
    exact = dtype == torch.float32
    for name, a, b in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), compiled, eager):
        tol = dict(rtol=1e-6, atol=1e-6) if exact or name in ("logprobs", "entropy") else dict(rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")
    assert eager[0].view(-1)[3] == 0 and compiled[0].view(-1)[3] == 0  # ignored target: log-prob 0
    if dtype == torch.bfloat16:  # a bf16 GEMM input: the gradient differs by at most bf16 rounding
        rel = (compiled[2].float() - eager[2].float()).norm() / eager[2].float().norm()
        assert rel < 1e-2, rel


def test_compiled_without_entropy_and_one_chunk():
    hidden, weight, targets = _inputs(torch.float32, n=11)
    for kernels in ("eager", "compiled"):
        lp, ent = fused_vocab_parallel_logprobs(hidden, weight, targets, kernels=kernels, with_entropy=False)
        assert ent is None
        if kernels == "eager":
            ref = lp
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-6)


def test_gradcheck_float64_through_compiled_kernels():
    hidden, weight, targets = _inputs(torch.float64, n=8, h=5, v=9)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def fn(h, w):
        return fused_vocab_parallel_logprobs(h, w, targets, temperature=0.8, chunk_size=3, kernels="compiled")

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_choice_of_form():
    cpu = torch.device("cpu")
    assert chunk_ops(cpu, "auto") is EAGER  # CPU: eager unless asked
    assert chunk_ops(cpu, "eager") is EAGER
    assert chunk_ops(cpu, "compiled").form == "compiled"
    with pytest.raises(ValueError, match="kernels must be one of"):
        chunk_ops(cpu, "triton")  # type: ignore[arg-type]
    hidden, weight, targets = _inputs(torch.float32)
    with pytest.raises(ValueError, match="kernels must be one of"):
        fused_vocab_parallel_logprobs(hidden, weight, targets, kernels="fast")  # type: ignore[arg-type]


def test_failed_compile_warns_once_and_runs_eager(monkeypatch, caplog):
    def broken(*args):
        raise TorchDynamoException("no C compiler found\nlong trace")

    monkeypatch.setattr(chunk_kernels, "_auto_failed", None)
    ops = chunk_kernels._guarded(chunk_kernels.ChunkOps("compiled", broken, broken, False))
    hidden, weight, targets = _inputs(torch.float32, n=9)
    logits = hidden @ weight.t()
    col, in_shard = targets[:, None].clamp(min=0), (targets >= 0)[:, None]
    with caplog.at_level(logging.WARNING, logger=chunk_kernels.__name__):
        got = ops.stats(logits.clone(), col, in_shard, 1.0, torch.float32, True)  # eager overwrites its input
        again = ops.stats(logits.clone(), col, in_shard, 1.0, torch.float32, True)
    want = EAGER.stats(logits.clone(), col, in_shard, 1.0, torch.float32, True)
    for a, b, c in zip(got, again, want):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(b, c)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "fused log-prob head: torch.compile failed (TorchDynamoException: no C compiler found); running eager"
    ]
    assert chunk_ops(torch.device("cuda"), "auto") is EAGER  # the process stays eager after a failure

    def oom(*args):  # not a compile failure: raised, not hidden
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(chunk_kernels, "_auto_failed", None)
    with pytest.raises(torch.OutOfMemoryError):
        chunk_kernels._guarded(chunk_kernels.ChunkOps("compiled", oom, oom, False)).stats(
            logits, col, in_shard, 1.0, None, True
        )


def test_probe_finds_a_failing_compile_before_the_chunk_size_is_chosen(monkeypatch, caplog):
    def broken(*args):
        raise TorchDynamoException("Triton needs a C compiler\nmore")

    monkeypatch.setattr(chunk_kernels, "_auto_failed", None)
    monkeypatch.setattr(chunk_kernels, "_probed", set())
    monkeypatch.setattr(chunk_kernels, "_compiled", chunk_kernels.ChunkOps("compiled", broken, broken, False))
    with caplog.at_level(logging.WARNING, logger=chunk_kernels.__name__):
        chunk_kernels._probe(torch.device("cpu"), torch.bfloat16)
    assert chunk_kernels._auto_failed == "TorchDynamoException: Triton needs a C compiler"
    assert len(caplog.records) == 1 and ("cpu", torch.bfloat16) in chunk_kernels._probed

    monkeypatch.setattr(chunk_kernels, "_auto_failed", None)
    monkeypatch.setattr(chunk_kernels, "_compiled", None)  # the real compiled kernels: the probe builds them
    chunk_kernels._probe(torch.device("cpu"), torch.float32)
    assert chunk_kernels._auto_failed is None


def test_graph_variants_of_a_run_do_not_hit_dynamos_recompile_limit(monkeypatch):
    """A run's heads bring several graphs per function (fp32 and bf16 logits, one target or K, a last
    chunk of one token); dynamo fails hard under fullgraph past its recompile limit (8 by default),
    so the kernels carry their own. Here the global limit is 1 and four variants still compile."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    for dtype, k, n in ((torch.float32, 1, 9), (torch.float32, 3, 9), (torch.bfloat16, 1, 9), (torch.float32, 1, 1)):
        hidden, weight, targets = _inputs(dtype, n=max(n, 8), k=k)
        fused_vocab_parallel_logprobs(
            hidden[:n].requires_grad_(True), weight, targets[:n], kernels="compiled", chunk_size=4
        )[0].sum().backward()


def test_compiled_chunks_hold_twice_the_bf16_tokens_in_the_same_bytes():
    """Eager temporaries are fp32 [c, V/tp]; compiled ones are in the GEMM's dtype, so with bf16
    weights the default chunk holds twice the tokens (fewer passes over the fp32 grad_W accumulator)."""
    from gspo_megatron.losses.chunking import DEFAULT_CHUNK_BYTES, chunk_tokens

    v = 151936
    compiled = chunk_ops(torch.device("cpu"), "compiled")
    eager_c = chunk_tokens(None, v, EAGER.temp_bytes(torch.bfloat16))
    assert eager_c == DEFAULT_CHUNK_BYTES // (4 * v) == 441
    assert chunk_tokens(None, v, compiled.temp_bytes(torch.bfloat16)) == DEFAULT_CHUNK_BYTES // (2 * v) == 883
    assert chunk_tokens(None, v, compiled.temp_bytes(torch.float32)) == eager_c
    assert chunk_tokens(64, v, compiled.temp_bytes(torch.bfloat16)) == 64  # an explicit chunk_size stands
