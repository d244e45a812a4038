"""The fused log-prob head in the real model path (Megatron GPTModel, tiny MoE, Megatron's schedule):
hidden states + output weight give the same log-probs, entropies, loss metrics and parameter
gradients (output weight / tied embedding included) as GPTModel's logits + the chunked path, on one
rank (and with the compiled per-chunk kernels), TP2 with sequence parallelism (tied and untied
embeddings) and PP2."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from fused_model_workers import fused_vs_logits


def _check(results):
    for r in results:
        fused, plain = r[True], r[False]
        if r[True]["last"]:  # 4 loss-function calls per path (2 micro-batches, log-prob pass + training)
            assert fused["calls"] == [fused["hidden"]] * 4 and plain["calls"] == [plain["vocab_local"]] * 4
            for a, b in zip(fused["logprobs"], plain["logprobs"]):
                torch.testing.assert_close(a["logprobs"], b["logprobs"], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(a["entropy"], b["entropy"], rtol=1e-5, atol=1e-5)
                assert (a["logprobs"] != 0).any()
            for a, b in zip(fused["metrics"], plain["metrics"]):
                assert a.keys() == b.keys()
                for k in a:
                    assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
        assert fused["grads"].keys() == plain["grads"].keys() and fused["grads"]
        for name, g in fused["grads"].items():
            torch.testing.assert_close(g, plain["grads"][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_single_rank(tied):
    _check(run_ranks(fused_vs_logits, 1, [], tied, timeout=300))


def test_single_rank_compiled_kernels():
    """The head as a GPU runs it (per-chunk arithmetic torch.compile'd; here Inductor's C++ backend)
    inside Megatron's schedule: the same log-probs, metrics and gradients as the logits path."""
    results = run_ranks(fused_vs_logits, 1, [], False, "compiled", timeout=600)
    assert results[0][True]["forms"] == ["compiled"]
    _check(results)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tp2_sequence_parallel(tied):
    _check(run_ranks(fused_vs_logits, 2, ["parallel.tp=2"], tied, timeout=300))


def test_pp2():
    _check(run_ranks(fused_vs_logits, 2, ["parallel.pp=2"], False, timeout=300))
