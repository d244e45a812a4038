"""Run a function on N gloo ranks (torch.multiprocessing spawn) and collect each rank's result.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in fresh processes with
MASTER_ADDR/PORT, RANK, WORLD_SIZE set; returns the list of return values (rank order). A rank's
exception is re-raised in the parent with its traceback text.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, outdir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn, world_size: int, *args, timeout: float = 600):
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(world_size, _free_port(), outdir, fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        errors = []
        try:
            while not ctx.join(timeout=timeout):
                pass
        except Exception as e:  # a rank failed: report the first traceback we saved
            errors.append(str(e))
        results = []
        for r in range(world_size):
            path = os.path.join(outdir, f"rank{r}.pt")
            if not os.path.exists(path):
                results.append(None)
                continue
            data = torch.load(path, weights_only=False)
            if not data["ok"]:
                raise RuntimeError(f"rank {r} failed:\n{data['error']}")
            results.append(data["result"])
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
