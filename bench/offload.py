"""The first ``offload()`` of a run with and without the host memory reserved at start-up
(``rollout.offload_train``; ``trainer/offload.py``, ``trainer/host_arena.py``).

A training state of about ``--gib`` GiB on the device: fp32 parameters in ``--tensors`` tensors of
mixed sizes, their gradients and torch Adam's two moments (one optimizer step taken), which is the
shape of what ``TrainStateOffloader`` moves (4 x the parameter bytes). In the same process, each
with its own ``TrainStateOffloader`` (both kept alive, so the second never reuses the first's pinned
blocks from PyTorch's host cache):

- reserved: ``reserve()`` (what ``train.build_trainer`` does), then ``--overlap-s`` seconds of other
  work (standing for the checkpoint load and the engine start), then the first offload; its time,
  the reservation's ``offload/host_alloc_s`` and the part the offload waited for
  (``offload/host_wait_s``);
- baseline: no reservation: the first offload allocates its host memory inside it (what every run
  did before ``reserve``);
then a second offload / reload of the baseline (the steady state: nothing allocated).

Prints the first offload's seconds in each mode, the steady offload and reload, GB/s, and the ratios
reserved / baseline and reserved / steady. On CPU (``--device cpu``) host memory is not pinned and
the same code runs (the CI form, through ``bench/gpu_check.py --dry-run``).

Usage: python bench/offload.py [--gib 4] [--tensors 64] [--overlap-s 0] [--device auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from gspo_megatron.trainer.offload import TrainStateOffloader


class _Chunk(torch.nn.Module):
    """The attributes ``TrainStateOffloader`` reads from a Megatron DDP chunk (no contiguous buffers:
    every parameter its own storage, as without the distributed optimizer)."""

    buffers: list = []
    expert_parallel_buffers: list = []

    def __init__(self, sizes: list[int], device: torch.device):
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes)


class _Optimizer:
    """A Megatron optimizer's shape: ``.optimizer`` is the torch optimizer."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.optimizer = inner


def make_state(gib: float, tensors: int, device: torch.device) -> tuple[_Chunk, _Optimizer]:
    """Parameters of about gib / 4 GiB in ``tensors`` tensors (sizes 1..tensors in proportion), their
    gradients, and Adam's moments after one step: about ``gib`` GiB in all."""
    elems = int(gib * 2**30 / 4 / 4)
    weights = list(range(1, tensors + 1))
    sizes = [max(1, elems * w // sum(weights)) for w in weights]
    model = _Chunk(sizes, device)
    opt = _Optimizer(torch.optim.Adam(model.parameters(), lr=1e-3, capturable=device.type == "cuda"))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
        p.main_grad = p.grad
    opt.optimizer.step()
    return model, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def run(gib: float, tensors: int, overlap_s: float, device: torch.device) -> dict:
    model, opt = make_state(gib, tensors, device)
    reserved = TrainStateOffloader(model, opt, device=device)
    t0 = time.perf_counter()
    reserved.reserve()
    reserve_call_s = time.perf_counter() - t0
    time.sleep(overlap_s)  # the checkpoint load and the engine start
    first_reserved = timed(reserved.offload, device)
    timed(reserved.reload, device)
    met = reserved.metrics()

    baseline = TrainStateOffloader(model, opt, device=device)
    first_baseline = timed(baseline.offload, device)
    timed(baseline.reload, device)
    steady_offload = timed(baseline.offload, device)
    steady_reload = timed(baseline.reload, device)
    nbytes = met["offload/bytes"]
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "state_gib": nbytes / 2**30,
        "overlap_s": overlap_s,
        "reserve_call_s": reserve_call_s,
        "host_alloc_s": met["offload/host_alloc_s"],
        "host_wait_s": met["offload/host_wait_s"],
        "host_gib": met["offload/host_bytes"] / 2**30,
        "host_grown_bytes": met["offload/host_grown_bytes"],
        "first_offload_reserved_s": first_reserved,
        "first_offload_baseline_s": first_baseline,
        "steady_offload_s": steady_offload,
        "steady_reload_s": steady_reload,
        "steady_offload_gb_s": nbytes / steady_offload / 1e9,
        "ratio_first_reserved_vs_baseline": first_reserved / first_baseline,
        "ratio_first_reserved_vs_steady": first_reserved / steady_offload,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0, help="the training state's size (params + grads + Adam)")
    ap.add_argument("--tensors", type=int, default=64, help="parameter tensors (mixed sizes)")
    ap.add_argument("--overlap-s", type=float, default=0.0, help="seconds between reserve() and the first offload")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")
    r = run(args.gib, args.tensors, args.overlap_s, device)
    print(f"{r['device']}: training state {r['state_gib']:.2f} GiB, host memory {r['host_gib']:.2f} GiB")
    print(f"  reserve(): returns in {r['reserve_call_s']:.3f} s, pins in {r['host_alloc_s']:.2f} s (background)")
    print(
        f"  first offload, reserved {r['overlap_s']:.1f} s before: {r['first_offload_reserved_s']:.3f} s "
        f"(waited {r['host_wait_s']:.2f} s for the reservation)"
    )
    print(f"  first offload, no reservation:    {r['first_offload_baseline_s']:.3f} s")
    print(
        f"  steady offload {r['steady_offload_s']:.3f} s ({r['steady_offload_gb_s']:.1f} GB/s), "
        f"reload {r['steady_reload_s']:.3f} s"
    )
    print(
        f"  ratio first offload reserved / no reservation: {r['ratio_first_reserved_vs_baseline']:.3f}; "
        f"reserved / steady: {r['ratio_first_reserved_vs_steady']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
