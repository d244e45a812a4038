"""The process of one engine TP rank of the CPU server: join the engine's gloo world, build its
:class:`~gspo_megatron.cpu_server.worker.TPWorker`, then serve the HTTP front's commands until shutdown
(TP rank 0 reads each from the pipe and broadcasts it; every rank answers; rank 0 merges the answers as
sglang's ``FanOutCommunicator.merge_results`` does: :func:`merge`). An exception sglang's scheduler dies
of (``sglang_runtime.SchedulerDeath``) ends the rank and the server; any other fails the one request."""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gspo_megatron.cpu_server.args import ServerArgs
from gspo_megatron.cpu_server.sglang_runtime import SchedulerDeath
from gspo_megatron.cpu_server.worker import TPWorker, log
from gspo_megatron.runtime import children

IDLE_TIMEOUT = timedelta(days=30)  # ranks > 0 wait in a broadcast between commands


def merge(results: list[dict]) -> dict:
    """All ranks' answers -> one: success only if every rank succeeded (messages of failures)."""
    ok = all(r.get("success", True) for r in results)
    out = dict(results[0])
    out["success"] = ok
    if not ok:
        msgs = [r.get("message", "") for r in results if not r.get("success", True)]
        out["message"] = msgs[0] if len(set(msgs)) == 1 else "; ".join(f"{m}" for m in msgs)
        out["bad_request"] = any(r.get("bad_request") for r in results)
    out["ranks"] = results
    return out


def run_worker(args: ServerArgs, tp_rank: int, init_addr: str, conn: Any, parent_pid: int) -> None:
    """Process entry: join the engine's gloo world, load the shards, serve commands until shutdown.
    ``conn`` (rank 0 only) is the pipe to the HTTP front."""
    children.die_with_parent(parent_pid)  # the kernel kills this rank when the server process dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    torch.set_num_threads(1)
    try:
        host, port = init_addr.rsplit(":", 1)  # node 0's server process hosts the store
        store = dist.TCPStore(host, int(port), args.tp_size, False, IDLE_TIMEOUT)
        dist.init_process_group("gloo", store=store, world_size=args.tp_size, rank=tp_rank, timeout=IDLE_TIMEOUT)
        t0 = time.monotonic()
        worker = TPWorker(args, tp_rank)
        worker._refresh_full_model()  # rank 0's model ready before the first health check
        dist.barrier()
        log(
            tp_rank, f"weights loaded ({worker.store.resident_bytes()} bytes of shards) in {time.monotonic() - t0:.1f}s"
        )
    except Exception as e:  # noqa: BLE001 - reported to the parent through the pipe; the rank exits 1
        log(tp_rank, f"start-up failed: {type(e).__name__}: {e}")
        if conn is not None:
            conn.send({"success": False, "message": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    if conn is not None:
        conn.send({"success": True, "message": "ready"})
    while True:
        box: list[Any] = [None]  # rank 0's command (op, kw), broadcast to the other ranks
        if tp_rank == 0:
            try:
                box = [conn.recv()]
            except EOFError:
                box = [("shutdown", {})]
        dist.broadcast_object_list(box, src=0)
        op, kw = box[0]
        try:
            result = worker.handle(op, kw)
        except SchedulerDeath as e:  # sglang's scheduler exits; so does this rank, and the server with it
            traceback.print_exc()
            log(tp_rank, f"Scheduler hit an exception: {e}; exiting (sglang sends SIGQUIT to the server)")
            sys.stdout.flush()
            os._exit(1)  # no clean-up: the server process kills the other ranks
        except Exception as e:  # noqa: BLE001 - one failed request is answered, the server stays up
            traceback.print_exc()
            result = {"success": False, "message": f"{type(e).__name__}: {e}"}
        # every rank's answer, filled in on rank 0
        gathered: list[dict] | None = [{} for _ in range(args.tp_size)] if tp_rank == 0 else None
        dist.gather_object(result, gathered, dst=0)
        if gathered is not None:  # rank 0
            try:
                conn.send(merge(gathered))
            except (BrokenPipeError, OSError):
                op = "shutdown"
        if op == "shutdown":
            break
    for g in list(worker.groups.values()):
        try:
            dist.destroy_process_group(g)
        except Exception:  # noqa: BLE001 - tearing down: a group already broken by a dead peer
            pass
    dist.destroy_process_group()
