"""rollout.offload_train: the training state leaves the device and comes back bitwise.

- On 2 gloo ranks (EP2, so both the dense and the expert-parallel DDP buffers exist), for fp32 and
  bf16 models with the distributed optimizer and bf16 with the plain mixed-precision optimizer:
  after offload + reload the DDP param/grad buffers, every parameter and main_grad, the optimizer's
  fp32 main params and Adam states (step included) are byte-identical, every storage was resized to
  0 bytes while offloaded, views still alias their buffers, and the next optimizer step gives the
  same weights as without the round trip.
- End to end: gspo-train with rollout.offload_train=true gives the same loss curve as without.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from distributed_harness import run_ranks
from offload_workers import VARIANTS, offload_roundtrip
from train_utils import read_metrics, run_train


@pytest.fixture(scope="module")
def roundtrip(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    root = tmp_path_factory.mktemp("offload")
    save_tiny_hf_model("qwen3_moe", str(root / "hf"), seed=3, num_hidden_layers=2)
    return run_ranks(offload_roundtrip, 2, str(root / "hf"))


VARIANT_IDS = [f"{d}/{'distopt' if o else 'plain'}" for d, o in VARIANTS]


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_state_bitwise_equal_after_reload(roundtrip, variant):
    for rank_result in roundtrip:
        r = rank_result[variant]
        assert r["equal"] == [True, True]
        assert r["aliases"] == [True, True]
        # Adam's exp_avg / exp_avg_sq / step are in the compared state
        assert {"exp_avg", "exp_avg_sq", "step"} <= set(r["state_kinds"]), r["state_kinds"]
        assert r["n_state_keys"] > 0
        assert r["dtypes"] == ["torch." + variant.split("/")[0]]


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_storage_freed_while_offloaded(roundtrip, variant):
    for rank_result in roundtrip:
        r = rank_result[variant]
        assert r["left_bytes"] == [0, 0]
        assert all(r["freed"].values()), r["freed"]
        assert r["moved"][0] == r["moved"][1] > 0
        assert r["predicted"] == r["moved"][0]  # expected_bytes before the first step: Adam's state included
        assert r["double_offload_refused"]


@pytest.mark.parametrize("variant", VARIANT_IDS)
def test_next_step_unchanged_by_offload(roundtrip, variant):
    for rank_result in roundtrip:
        r = rank_result[variant]
        a, b = r["after_step_with_offload"], r["after_step_without"]
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_moved_bytes_cover_the_state():
    """One process, fp32, no DDP bookkeeping: the bytes moved are exactly params + grads + Adam."""
    from gspo_megatron.trainer.offload import TrainStateOffloader

    m, opt = _adam_chunk((5, 3))  # main_grad shares the grad's storage: counted once
    opt.optimizer.step()
    n = 15 + 7
    expected = 4 * (n + n + 2 * n) + 2 * 4  # params, grads, exp_avg + exp_avg_sq, two fp32 step tensors
    off = TrainStateOffloader(m, opt)
    assert off.offload() == expected
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload()
    assert off.reload() == expected
    with pytest.raises(RuntimeError, match="nothing is offloaded"):
        off.reload()
    assert off.metrics()["offload/bytes"] == expected


def test_loss_curve_identical_with_offload(tmp_path):
    """gspo-train, the CPU demo, 4 steps, same seed: offload_train=true vs false."""
    runs = {}
    for flag in ("false", "true"):
        out = str(tmp_path / flag)
        run_train(out, ["train.steps=4", f"rollout.offload_train={flag}"])
        runs[flag] = read_metrics(out)
    # everything computed from the weights (losses, ratios, entropy, grad norm, rewards, log-prob gaps)
    keys = [
        k
        for k in runs["false"][0]
        if k.startswith(("loss/", "gspo/", "policy/", "train/", "reward/", "rollout/"))
        and k != "rollout/engine_restarts"
    ]
    assert {"loss/total", "train/grad_norm", "reward/mean", "policy/entropy"} <= set(keys), keys
    assert len(runs["false"]) == len(runs["true"]) == 4
    assert all(m["offload/bytes"] > 0 for m in runs["true"]) and "offload/bytes" not in runs["false"][0]
    # the host memory was reserved at start-up (train.build_trainer) and covered every offload
    assert all(
        m["offload/host_grown_bytes"] == 0 and m["offload/host_bytes"] >= m["offload/bytes"] for m in runs["true"]
    )
    for a, b in zip(runs["false"], runs["true"]):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_walks_into_chained_and_hybrid_optimizers():
    """Megatron's ChainedOptimizer (dense + expert optimizers) and HybridDeviceOptimizer
    (optimizer.cpu_offload_fraction; a torch Optimizer whose states live in .sub_optimizers) are
    walked into. (The real HybridDeviceOptimizer needs CUDA streams, so its shape is mimicked here.)"""
    from types import SimpleNamespace

    from gspo_megatron.trainer.offload import TrainStateOffloader

    dense, expert_main, expert_sub = (torch.nn.Parameter(torch.randn(4)) for _ in range(3))

    class Hybrid(torch.optim.Optimizer):
        def __init__(self):
            super().__init__([expert_main], {})
            self.sub_optimizers = [torch.optim.Adam([expert_sub])]

    dense_opt, hybrid = torch.optim.Adam([dense]), Hybrid()
    for p, opt in ((dense, dense_opt), (expert_sub, hybrid.sub_optimizers[0])):
        p.grad = torch.ones_like(p)
        opt.step()
    chained = SimpleNamespace(
        chained_optimizers=[SimpleNamespace(optimizer=dense_opt), SimpleNamespace(optimizer=hybrid)]
    )
    off = TrainStateOffloader([], chained)
    before = [
        t.clone()
        for t in (
            dense,
            expert_main,
            expert_sub,
            *dense_opt.state[dense].values(),
            *hybrid.sub_optimizers[0].state[expert_sub].values(),
        )
    ]
    moved = off.offload()
    assert moved == 3 * 16 + 2 * 16 + 2 * (16 + 16 + 4)  # 3 params, 2 grads, 2 x (exp_avg, exp_avg_sq, step)
    assert hybrid.sub_optimizers[0].state[expert_sub]["exp_avg"].untyped_storage().nbytes() == 0
    off.reload()
    after = [
        dense,
        expert_main,
        expert_sub,
        *dense_opt.state[dense].values(),
        *hybrid.sub_optimizers[0].state[expert_sub].values(),
    ]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_loaded_call_brings_the_state_back_for_the_call():
    from types import SimpleNamespace

    from gspo_megatron.trainer.offload import TrainStateOffloader

    p = torch.nn.Parameter(torch.arange(4.0))
    chunk = SimpleNamespace(buffers=[], expert_parallel_buffers=[], parameters=lambda: [p])
    off = TrainStateOffloader([chunk], None)
    read = off.loaded_call(lambda scale: (p.detach() * scale).tolist())
    assert read(2) == [0.0, 2.0, 4.0, 6.0]  # not offloaded: plain call
    off.offload()
    assert read(3) == [0.0, 3.0, 6.0, 9.0]  # offloaded: reloaded for the call ...
    assert off.offloaded and p.untyped_storage().nbytes() == 0  # ... and offloaded again after
    failing = off.loaded_call(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing()
    assert off.offloaded
    off.reload()
    assert p.tolist() == [0.0, 1.0, 2.0, 3.0]


def _adam_chunk(shape_a: tuple[int, ...] = (50, 3)):
    """A one-process model shaped like a Megatron DDP chunk (the attributes the offloader reads:
    parameters ``a`` of ``shape_a`` and ``b`` [7], their grads, ``main_grad`` sharing the grad's
    storage) with a Megatron-shaped optimizer around torch's Adam, no state yet (as at start-up)."""

    class Chunk(torch.nn.Module):
        buffers: list = []
        expert_parallel_buffers: list = []

        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.randn(*shape_a))
            self.b = torch.nn.Parameter(torch.randn(7))

    class Opt:  # a Megatron optimizer's shape: .optimizer is the torch optimizer
        pass

    m, opt = Chunk(), Opt()
    opt.optimizer = torch.optim.Adam(m.parameters())
    for p in m.parameters():
        p.grad = torch.randn_like(p)
        p.main_grad = p.grad
    return m, opt


def test_host_arena_lays_sizes_over_power_of_two_chunks():
    """Every size's pieces tile its bytes in order, pieces of different sizes never overlap, chunks
    are powers of two (the last one covering the rest), and a request beyond the capacity grows it."""
    from gspo_megatron.trainer.host_arena import HostArena

    arena = HostArena(pin=False, chunk_bytes=64)
    arena.reserve(150)
    sizes = [10, 100, 1, 39]
    layout = arena.pieces(sizes)
    assert [c.numel() for c in arena.chunks] == [64, 64, 32] and arena.grown_bytes == 0
    seen = set()
    for n, pieces in zip(sizes, layout):
        starts = [0] + [h.numel() for _, h in pieces[:-1]]
        assert [start for start, _ in pieces] == list(itertools.accumulate(starts))
        assert sum(h.numel() for _, h in pieces) == n
        for _, h in pieces:
            span = range(h.data_ptr(), h.data_ptr() + h.numel())
            assert not seen.intersection(span)
            seen.update(span)
    assert [len(p) for p in layout] == [1, 2, 1, 2]  # 100 bytes from byte 10: 54 + 46; 39 from 111: 17 + 22
    arena.pieces([200])
    assert arena.grown_bytes == 64 and arena.capacity == 224
    with pytest.raises(ValueError, match="power of two"):
        HostArena(pin=False, chunk_bytes=48)


def test_reserved_host_memory_covers_the_first_steps():
    """reserve() at start-up predicts the Adam moments the first step creates: neither the offload
    before the first step nor the one after it allocates (host_grown_bytes 0), the reservation is
    what the state needs plus under one chunk, and the round trip through chunks smaller than the
    tensors (every storage spans several) is bitwise."""
    from gspo_megatron.trainer.offload import TrainStateOffloader

    m, opt = _adam_chunk()
    off = TrainStateOffloader(m, opt, chunk_bytes=128)
    n = 150 + 7
    state_after_step = 4 * (n + n + 2 * n) + 2 * 4  # params, grads, exp_avg + exp_avg_sq, two fp32 steps
    assert off.expected_bytes() == state_after_step
    off.reserve()
    before = [t.clone() for t in (m.a, m.b, m.a.grad, m.b.grad)]
    assert off.offload() == 4 * 2 * n
    assert off.reload() == 4 * 2 * n
    assert all(torch.equal(x, y) for x, y in zip(before, (m.a, m.b, m.a.grad, m.b.grad)))
    opt.optimizer.step()
    after = [t.clone() for t in (m.a, *opt.optimizer.state[m.a].values(), *opt.optimizer.state[m.b].values())]
    assert off.offload() == state_after_step
    off.reload()
    assert all(
        torch.equal(x, y)
        for x, y in zip(after, (m.a, *opt.optimizer.state[m.a].values(), *opt.optimizer.state[m.b].values()))
    )
    met = off.metrics()
    assert met["offload/host_grown_bytes"] == 0
    assert state_after_step <= met["offload/host_bytes"] < state_after_step + 128
    assert met["offload/host_alloc_s"] >= met["offload/host_wait_s"] >= 0


def test_offload_without_reservation_allocates_then_and_a_failed_reservation_is_raised():
    from gspo_megatron.trainer.offload import TrainStateOffloader

    m, opt = _adam_chunk()
    off = TrainStateOffloader(m, opt, chunk_bytes=256)
    assert off.offload() == 4 * 2 * 157 and off.metrics()["offload/host_grown_bytes"] >= 4 * 2 * 157
    off.reload()

    m, opt = _adam_chunk()
    off = TrainStateOffloader(m, opt)

    def refuse(nbytes):
        raise RuntimeError("CUDA error: out of memory (pinned)")

    off.arena._grow = refuse  # the allocator failing in the background thread
    off.reserve()
    with pytest.raises(RuntimeError, match="out of memory"):
        off.offload()
    assert not off.offloaded and m.a.untyped_storage().nbytes() > 0  # nothing was freed
