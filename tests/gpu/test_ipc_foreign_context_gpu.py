"""GPU test: the memory a CUDA context costs when a process opens a CUDA IPC handle of a GPU it does
not otherwise use (``rollout.sync_owner_direct``: each engine TP process opens the holders' buffers on
the node's other GPUs; ``planner.FOREIGN_CONTEXT_GIB`` plans that cost per (process, foreign GPU)).

On one GPU: the parent allocates a buffer and shares it (torch's CUDA IPC reduction); a spawned child
that has not touched CUDA opens it, which creates the child's context on that GPU, the same as an
engine process's context on a foreign GPU. The parent reads the GPU's free memory
(``torch.cuda.mem_get_info``, driver-wide) before and after the child opened the handle, prints the
difference (docs/gpu.md records it) and checks it is within the planner's figure.
Spawned children re-import this module: keep its top level to pytest and torch.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

pytestmark = pytest.mark.gpu


def _open_handle(q_in, q_out) -> None:
    t = q_in.get()  # rebuilding the tensor opens the IPC handle: this process's first CUDA use
    torch.cuda.synchronize()
    q_out.put(float(t[:4].sum().item()))
    q_in.get()  # hold the context until the parent has measured


def test_opening_an_ipc_handle_costs_one_context_within_the_planners_figure():
    from gspo_megatron.features.owner_direct import FOREIGN_CONTEXT_GIB
    from gspo_megatron.planner import GIB

    buf = torch.ones(16 << 20, device="cuda")  # 64 MiB, mapped (not copied) by the child
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_open_handle, args=(q_in, q_out))
    child.start()
    try:
        free_before = torch.cuda.mem_get_info()[0]
        q_in.put(buf)
        assert q_out.get(timeout=300) == 4.0
        free_after = torch.cuda.mem_get_info()[0]
        cost = (free_before - free_after) / GIB
        print(f"foreign CUDA context: {cost:.3f} GiB ({torch.cuda.get_device_name()}, torch {torch.__version__})")
        assert 0 < cost <= FOREIGN_CONTEXT_GIB, cost
    finally:
        q_in.put(None)
        child.join(60)
        if child.is_alive():
            child.kill()
