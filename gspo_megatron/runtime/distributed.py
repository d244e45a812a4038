"""torch.distributed + Megatron parallel state, from the parallel section of the config.

Every rank calls ``init_distributed`` once at start-up (under torchrun the rank/world come from the
environment; a single process without torchrun becomes a world of one). NCCL with GPUs, gloo without
(then the CPU compatibility layer is activated before any Megatron module is used).
"""

from __future__ import annotations

import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from gspo_megatron.runtime import cpu_compat
from gspo_megatron.runtime.ports import free_port
from gspo_megatron.runtime.world_layout import world_layout_errors


@dataclass(frozen=True)
class ParallelLayout:
    """Model-parallel sizes; data parallel is derived from the world size."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel; None: same as tp
    cp: int = 1
    sequence_parallel: bool = False

    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        return world_size // self.model_parallel_size()

    def check(self, world_size: int) -> None:
        """Raise ValueError naming the field when the layout cannot be built on ``world_size`` ranks
        (:func:`world_layout_errors`; the model's own rules are ``parallel_layout.layout_errors``'s, which
        the callers ran before)."""
        etp = self.tp if self.etp is None else self.etp
        errors = world_layout_errors(self.tp, self.pp, self.ep, etp, self.cp, world_size=world_size)
        if errors:
            raise ValueError("; ".join(errors))


def device() -> torch.device:
    """The device this rank computes on."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(timeout_minutes: int = 30) -> None:
    """The default torch.distributed group only (idempotent): NCCL with a GPU, else gloo; a world
    of one under plain ``python``. Every rank calls it."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python`: a world of one
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def init_distributed(layout: ParallelLayout, seed: int = 1234, timeout_minutes: int = 30) -> None:
    """Initialize torch.distributed (idempotent), Megatron's parallel state, and all RNGs.

    Called by every rank. Raises ValueError before any group is created if the layout does not fit.
    """
    cpu_compat.activate()
    cpu_compat.patch_missing_te()
    init_process_group(timeout_minutes)
    world = dist.get_world_size()
    layout.check(world)

    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        _destroy_megatron_groups(ps)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=timeout_minutes,
    )
    seed_everything(seed)


def _destroy_megatron_groups(ps) -> None:
    """Before a re-initialization in the same process (the conversion tools, tests reading one
    checkpoint in several layouts): Megatron's ``destroy_model_parallel`` only forgets its process
    groups; the groups themselves (gloo: sockets and a thread each, a few dozen per layout) stay
    registered with torch.distributed, and every later collective got slower as they piled up
    (measured: reading six tiny checkpoints in five layouts each on 4 ranks took 178 s with the
    groups left alive, 36 s with them destroyed). Destroys the groups parallel_state holds, then
    its state. Models built in the previous layout must not be used afterwards (they were already
    wrong for the new one)."""
    groups: list[dist.ProcessGroup] = []
    for value in vars(ps).values():
        for g in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(g, dist.ProcessGroup) and g is not dist.group.WORLD and all(g is not x for x in groups):
                groups.append(g)
    ps.destroy_model_parallel()
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except ValueError:  # not registered with torch.distributed (an alias kept by Megatron)
            pass


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy, torch, and Megatron's model-parallel RNG tracker (same seed on every rank;
    Megatron offsets the tensor-parallel and expert-parallel streams per rank)."""
    from megatron.core.tensor_parallel import random as mrandom

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    mrandom.initialize_rng_tracker(force_reset=True)
    mrandom.model_parallel_cuda_manual_seed(seed, force_reset_rng=True) if _accepts_force_reset(
        mrandom.model_parallel_cuda_manual_seed
    ) else mrandom.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)  # the tracker's `add` reseeds the default generator on CPU


def _accepts_force_reset(fn) -> bool:
    import inspect

    return "force_reset_rng" in inspect.signature(fn).parameters


def rank() -> int:
    """This process's global rank (0 when torch.distributed is not initialized)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """The number of global ranks (1 when torch.distributed is not initialized)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every global rank (collective; a no-op in a world of one or without
    torch.distributed)."""
    if world_size() > 1:
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s picklable ``obj`` on every rank (collective; returns ``obj`` in a world of one)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is set on any rank (collective; the flag itself in a world of one)."""
    if world_size() == 1:
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device())  # NCCL needs the GPU
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group (tests call this between runs)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
