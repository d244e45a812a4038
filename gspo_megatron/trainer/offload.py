"""Training state off the accelerator while colocated engines generate (``rollout.offload_train``).

``TrainStateOffloader(ddp_models, optimizer)`` with ``offload()`` / ``reload()``. Every training rank
calls both, at the same points of the loop (``orchestration.colocation.Colocation``, which the rollout
session calls: ``offload()`` before the rollout, ``reload()`` after the engines released their memory
and before the train step; its sync hook runs a sync through ``loaded_call`` so that a re-sync (and
its check) inside the rollout, after an engine restart, finds the weights). No collective is
involved: each rank moves its own state.

What moves (every tensor storage that lives on the training device, each moved once however many
views share it):
- the Megatron DDP contiguous buffers of every model chunk (``buffers`` and
  ``expert_parallel_buffers``): ``param_data`` (bf16/fp32 model weights; present with the distributed
  optimizer) and ``grad_data`` (the ``main_grad`` buffer, fp32 with ``grad_reduce_in_fp32``);
- the model parameters and their ``main_grad`` / ``grad`` when they are not views of a buffer
  (without the distributed optimizer Megatron DDP keeps each ``param.data`` in its own storage);
- the optimizer: every parameter of the inner torch optimizer(s) (the fp32 main params of the mixed
  precision / distributed optimizer; for an fp32 model with the distributed optimizer they are views
  of ``param_data`` and so already counted), their ``.grad`` and every tensor of ``optimizer.state``
  (Adam ``exp_avg`` / ``exp_avg_sq``, and ``step`` when it is a tensor). ``ChainedOptimizer`` and
  Megatron's ``HybridDeviceOptimizer`` (``optimizer.cpu_offload_fraction``) are walked into; what
  already lives in host memory there is left alone.
Module buffers (rotary tables, router statistics) stay: they are small and not training state.

How: per storage ``S`` of ``n`` bytes, ``offload`` copies its bytes into host memory (the
``trainer.host_arena.HostArena``: pinned chunks when CUDA, reused by every offload), then
``S.resize_(0)`` frees the device memory;
``reload`` does ``S.resize_(n)`` and copies the bytes back. The storage *object* is the one every
view (``param.data``, ``param.main_grad``, bucket views, the optimizer's shard views) points to, so
every view sees the restored bytes: the state after ``reload`` is bitwise the state before
``offload``. On CUDA, ``offload`` ends with ``torch.cuda.synchronize()`` and
``torch.cuda.empty_cache()`` (the freed blocks go back to the driver, where the engine processes can
use them). On CPU the same code runs: the device is the CPU, the copy goes to a fresh CPU tensor and
the original storage is freed, so CI tests the path. Between ``offload`` and ``reload`` the model and
optimizer must not be used (their tensors have no bytes).

Why a manual move, and not torch_memory_saver or Megatron-Core's own offload:
- torch_memory_saver (what slime and SGLang itself use) pauses every allocation made inside its
  region through an LD_PRELOAD'ed CUDA allocator hook: CUDA only (CI could not run the path), the
  model and optimizer would have to be allocated inside its region, and its CPU backup is per
  region, not per tensor kind.
- Megatron-Core 0.16.1's pieces do not compose into "everything back bitwise":
  ``_ParamAndGradBuffer.offload_to_cpu`` drops the gradients (``reload_from_cpu`` zeroes them) and
  its ``param_data.cpu().pin_memory()`` is not a copy on CPU (``.cpu()`` of a CPU tensor is the tensor
  itself, so the following ``resize_(0)`` destroys the only copy); ``MegatronOptimizer.offload_to_cpu``
  rebinds ``p.data`` / the state entries to new tensors (views held elsewhere, e.g. the distributed
  optimizer's shard views, keep pointing at the old storage) and moves only ``is_cuda`` tensors.
- verl offloads Megatron models the same way as here (``buffer.param_data`` copied to pinned host
  memory, then ``storage().resize_(0)``), separately for the optimizer states; this module does it
  once for every storage of the training state, deduplicated, with the gradients kept.
Cost: one device->host and one host->device copy of the state per step (pinned, ~20+ GB/s per GPU
on H100 PCIe/NVLink-C2C hosts), and pinned host memory equal to the state's size per rank (plus
under one 1 GiB chunk; the planner prints it). Pinning that memory is slow (about 1 s per GiB), so
:meth:`TrainStateOffloader.reserve` allocates it in a background thread when the trainer is built
(``train.build_trainer``), sized by :meth:`TrainStateOffloader.expected_bytes` (the state now plus
the Adam moments the optimizer creates at its first step); the first ``offload`` waits only for what
is left of it (``offload/host_wait_s``), and anything the prediction missed is allocated then
(``offload/host_grown_bytes``).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Iterator

import torch

from gspo_megatron.trainer.host_arena import CHUNK_BYTES, HostArena


def _training_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _inner_optimizers(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers inside a Megatron optimizer (chained, mixed precision, distributed, hybrid)."""
    if optimizer is None:
        return
    for sub in getattr(optimizer, "chained_optimizers", None) or []:
        yield from _inner_optimizers(sub)
    if hasattr(optimizer, "chained_optimizers"):
        return
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        yield inner
        for sub in getattr(inner, "sub_optimizers", None) or []:  # HybridDeviceOptimizer
            yield sub
    elif isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer


def _state_tensors(ddp_models, optimizer) -> Iterator[torch.Tensor]:
    """Every tensor of the training state, views included (deduplicated by storage later)."""
    for ddp in ddp_models:
        for buf in list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", [])):
            if buf.param_data is not None:
                yield buf.param_data
            if buf.grad_data is not None:
                yield buf.grad_data
        for p in ddp.parameters():
            yield p
            for t in (getattr(p, "main_grad", None), p.grad):
                if t is not None:
                    yield t
    for opt in _inner_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v


class TrainStateOffloader:
    """Moves this rank's parameters, gradients and optimizer states to host memory and back.

    ``ddp_models``: the Megatron DDP-wrapped model chunk(s) (one module or a list);
    ``optimizer``: the Megatron optimizer built over them. ``offload()`` then ``reload()``, strictly
    alternating (a second ``offload`` without ``reload`` raises). ``reserve()`` starts allocating
    the host memory in the background (module docstring). ``metrics()`` gives the last transfer's
    ``offload/bytes``, ``offload/offload_s``, ``offload/reload_s`` and the host memory's
    ``offload/host_bytes``, ``offload/host_alloc_s``, ``offload/host_wait_s``, ``offload/host_grown_bytes``.
    """

    def __init__(self, ddp_models, optimizer, device: torch.device | None = None, chunk_bytes: int = CHUNK_BYTES):
        self.ddp_models = list(ddp_models) if isinstance(ddp_models, (list, tuple)) else [ddp_models]
        self.optimizer = optimizer
        self.device = device or _training_device()
        self.pin = self.device.type == "cuda"
        self.arena = HostArena(self.pin, chunk_bytes)
        # (storage, nbytes, its host pieces) while offloaded
        self._moved: list[tuple[torch.UntypedStorage, int, list[tuple[int, torch.Tensor]]]] = []
        self.offloaded = False
        self._metrics = {"offload/bytes": 0.0, "offload/offload_s": 0.0, "offload/reload_s": 0.0}

    def _storages(self) -> list[torch.UntypedStorage]:
        seen, out = set(), []
        for t in _state_tensors(self.ddp_models, self.optimizer):
            if t.device != self.device:
                continue
            s = t.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            out.append(s)
        return out

    @staticmethod
    def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
        """A 1-D uint8 tensor over the whole storage."""
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def expected_bytes(self) -> int:
        """The bytes ``offload`` will move once the optimizer has stepped: the state's storages now,
        plus for every optimizer parameter on the device without state yet what its optimizer will
        add there (an Adam-family group, ``betas``: ``exp_avg`` and ``exp_avg_sq`` like the
        parameter, and torch's 4-byte ``step`` tensor, on the device when ``capturable`` / ``fused``
        and on the host otherwise, which is the device on CPU; SGD with
        momentum: one buffer like it; others: nothing)."""
        total = sum(s.nbytes() for s in self._storages())
        for opt in _inner_optimizers(self.optimizer):
            for group in opt.param_groups:
                like = 2 if "betas" in group else 1 if group.get("momentum") else 0
                on_device = self.device.type == "cpu" or group.get("capturable") or group.get("fused")
                step = 4 if like == 2 and on_device else 0  # torch's Adam: its step tensor lives here
                for p in group["params"]:
                    if p.device == self.device and not opt.state.get(p):
                        total += like * p.numel() * p.element_size() + step  # zeros_like(p): p's own size
        return total

    def reserve(self) -> None:
        """Start allocating :meth:`expected_bytes` of host memory in the background (returns at once);
        the first ``offload`` waits for it. Without it, that offload allocates what it needs."""
        self.arena.reserve(self.expected_bytes())

    def offload(self) -> int:
        """Copy every state storage to host memory and free it on the device. Returns the bytes moved."""
        if self.offloaded:
            raise RuntimeError("TrainStateOffloader.offload: the training state is already offloaded")
        t0 = time.perf_counter()
        storages = self._storages()
        sizes = [s.nbytes() for s in storages]
        layout = self.arena.pieces(sizes)  # waits for the start-up reservation
        for s, pieces in zip(storages, layout):
            src = self._bytes_view(s)
            for start, host in pieces:
                host.copy_(src[start : start + host.numel()], non_blocking=self.pin)
        total = sum(sizes)
        if self.pin:
            torch.cuda.synchronize(self.device)  # the copies are done before the memory is reused
        for s, n, pieces in zip(storages, sizes, layout):
            self._moved.append((s, n, pieces))
            s.resize_(0)
        if self.pin:
            torch.cuda.empty_cache()  # give the freed blocks back so the engines can use them
        self.offloaded = True
        self._metrics.update({"offload/bytes": float(total), "offload/offload_s": time.perf_counter() - t0})
        return total

    def reload(self) -> int:
        """Reallocate every offloaded storage on the device and copy its bytes back. Returns the bytes."""
        if not self.offloaded:
            raise RuntimeError("TrainStateOffloader.reload: nothing is offloaded")
        t0 = time.perf_counter()
        total = 0
        for s, n, pieces in self._moved:
            s.resize_(n)
            dst = self._bytes_view(s)
            for start, host in pieces:
                dst[start : start + host.numel()].copy_(host, non_blocking=self.pin)
            total += n
        if self.pin:
            torch.cuda.synchronize(self.device)
        self._moved = []
        self.offloaded = False
        self._metrics["offload/reload_s"] = time.perf_counter() - t0
        return total

    def loaded_call(self, fn: Callable) -> Callable:
        """``fn`` wrapped to run with the state on the device: if it is offloaded when called, it is
        reloaded for the call and offloaded again after. For code that may need the weights while
        they are away (an engine restarted during a rollout is re-synced there). Every rank calls the
        wrapped function at the same point, so every rank reloads and offloads together."""

        def call(*args, **kwargs):
            if not self.offloaded:
                return fn(*args, **kwargs)
            self.reload()
            try:
                return fn(*args, **kwargs)
            finally:
                self.offload()

        return call

    def metrics(self) -> dict:
        a = self.arena
        host = {
            "offload/host_bytes": float(a.capacity),
            "offload/host_alloc_s": a.alloc_s,
            "offload/host_wait_s": a.wait_s,
            "offload/host_grown_bytes": float(a.grown_bytes),
        }
        return {**self._metrics, **host}

    def storages(self) -> Iterable[torch.UntypedStorage]:
        """The storages ``offload`` would move now (for tests and memory accounting)."""
        return self._storages()
