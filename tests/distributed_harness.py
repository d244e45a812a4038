"""Run a function on N gloo ranks and collect each rank's result.

``run_ranks(fn, world_size, *args, timeout=600)`` calls ``fn(rank, world_size, *args)`` in fresh
processes with MASTER_ADDR/PORT, RANK, WORLD_SIZE set; returns the list of return values (rank
order). A rank's exception is re-raised in the parent with its traceback text.

The ranks fork from a multiprocessing fork server that imported torch, transformers and
megatron-core once (:data:`PRELOAD`; the server is a fresh interpreter that runs no test), so a call
costs a fork instead of about 4 s of imports a rank; each rank runs with the caller's environment and
``sys.path`` of the moment, as a spawned one would. A function marked :func:`fresh_process` (it
must act before megatron is imported), or every function when ``GSPO_TEST_SPAWN=1``, gets spawned
ranks instead, as do the ranks of a machine with a GPU.

Never hangs: when the ranks have not all finished after ``timeout`` seconds (a deadlocked
collective, a rank waiting on a dead peer), every live rank is asked to dump its Python stacks
(faulthandler, on SIGUSR2), then the ranks and their children are killed and the call raises
``RanksTimedOut`` with each rank's stacks. The same clean-up runs when the wait itself is interrupted
(pytest-timeout, Ctrl-C), so no rank outlives its test.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

from gspo_megatron.runtime.ports import free_port

STACK_SIGNAL = signal.SIGUSR2  # SIGUSR1 is the trainer's checkpoint-and-stop signal


# imported once by the fork server (a fresh interpreter started on the first call); each rank forks
# from it with these modules loaded instead of importing them again (about 4 s a rank on CPU)
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "gspo_megatron.runtime.distributed",
    "gspo_megatron.models.build",
    "gspo_megatron.models.weights",
]


def fresh_process(fn):
    """Mark a rank function that must start in a fresh interpreter: it puts an import hook in place
    before megatron is imported (tests/models/te_standin.py), which a rank forked with megatron
    already loaded cannot do. :func:`run_ranks` spawns its ranks."""
    fn.fresh_process = True
    return fn


def _start_method(fn) -> str:
    import multiprocessing

    if getattr(fn, "fresh_process", False) or os.environ.get("GSPO_TEST_SPAWN") == "1":
        return "spawn"
    if torch.cuda.is_available():  # GPU ranks start CUDA themselves: spawned, as torch advises
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (once a process)
    return "forkserver"


class RanksTimedOut(RuntimeError):
    """The ranks did not finish in time; the message holds each live rank's Python stacks."""


def _save_whole(obj, path: str) -> None:
    """Write ``obj`` so that ``path`` holds all of it or does not exist: a peer's failure makes
    ``join()`` terminate this rank, perhaps in the middle of the write."""
    torch.save(obj, path + ".part")
    os.replace(path + ".part", path)


def _entry(rank, world_size, port, outdir, fn, payload, environ):
    import faulthandler

    os.environ.clear()  # the caller's environment now (a fork-server child starts with the server's)
    os.environ.update(environ)
    args = pickle.loads(payload)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    stacks = open(os.path.join(outdir, f"rank{rank}.stacks"), "w")  # lives as long as the rank
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        result = fn(rank, world_size, *args)
        _save_whole({"ok": True, "result": result}, path)
    except BaseException:
        _save_whole({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - tearing down after the result is out
                pass


def _kill_tree(pids: list[int]) -> None:
    """SIGKILL each pid and every process below it (e.g. a checkpoint writer's helpers)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += p.children(recursive=True) + [p]
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _dump_stacks(ctx, outdir: str, world_size: int) -> str:
    """Signal every live rank to write its stacks, wait briefly, and return them as one text."""
    live = [(r, p) for r, p in enumerate(ctx.processes) if p.is_alive()]
    for _, p in live:
        try:
            os.kill(p.pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(2.0)
    parts = []
    for r in range(world_size):
        proc = ctx.processes[r]
        state = "running" if proc.is_alive() else f"exited with code {proc.exitcode}"
        try:
            with open(os.path.join(outdir, f"rank{r}.stacks")) as f:
                text = f.read().strip()
        except OSError:
            text = "(no stack dump: the rank had not started its function yet)"
        parts.append(f"--- rank {r} (pid {proc.pid}, {state}) ---\n{text or '(no stack dump)'}")
    return "\n".join(parts)


def run_ranks(fn, world_size: int, *args, timeout: float = 600):
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(
            _entry,
            # the arguments as bytes: a fork server receives a tensor's shared memory as one file
            # descriptor each, at most 256 a call (a checkpoint's tensors are more)
            args=(world_size, free_port(), outdir, fn, pickle.dumps(args), dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=_start_method(fn),
        )
        errors = []
        deadline = time.monotonic() + timeout
        finished = False
        try:
            while not finished:
                if time.monotonic() > deadline:
                    stacks = _dump_stacks(ctx, outdir, world_size)
                    raise RanksTimedOut(
                        f"{fn.__name__} on {world_size} ranks did not finish in {timeout:.0f}s; "
                        f"killed. Each rank's Python stacks:\n{stacks}"
                    )
                try:
                    finished = ctx.join(timeout=1.0)
                except Exception as e:  # noqa: BLE001 - a rank failed: report the first traceback we saved
                    errors.append(str(e))
                    finished = True
        except BaseException as e:
            if not finished:  # timed out here, or interrupted (pytest-timeout, Ctrl-C): leave no rank behind
                if not isinstance(e, RanksTimedOut):
                    print(
                        f"run_ranks interrupted; the ranks' Python stacks:\n{_dump_stacks(ctx, outdir, world_size)}",
                        file=sys.stderr,
                        flush=True,
                    )
                _kill_tree([p.pid for p in ctx.processes if p.is_alive()])
            raise
        # one rank failing makes join() kill the others; make sure their children are gone too
        _kill_tree([p.pid for p in ctx.processes if p.is_alive()])
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
