"""``python -m gspo_megatron.cpu_server <sglang.launch_server flags>``: start one engine.

This process starts the node's TP ranks (``rank_loop.run_worker``, spawned; ranks
``node_rank * tp/nnodes ...``), and on node rank 0 serves HTTP once every rank has loaded its
shards. Node 0's process hosts the TP ranks' rendezvous store (bound before the ranks start, on
``--dist-init-addr`` or an OS-assigned port). SIGTERM / SIGINT stop every TP process; the workers
die with this process even when it is killed with SIGKILL (PR_SET_PDEATHSIG and a parent-pid
watchdog). If a TP process dies, the server exits (code 1), as an SGLang server does when a
scheduler dies.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from typing import Sequence

from gspo_megatron.cpu_server.args import ServerArgs, parse_args


def _stop(procs: list, grace_s: float = 5.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _rendezvous_store(args: ServerArgs, timeout):
    """Node 0 hosts the TP ranks' store before they start: on ``--dist-init-addr`` (multi-node), else
    on a port the OS assigns at bind time (no window in which another process can take it)."""
    from torch.distributed import TCPStore

    host, port = args.dist_init_addr.rsplit(":", 1) if args.dist_init_addr else ("127.0.0.1", 0)
    return TCPStore(host, int(port), args.tp_size, True, timeout, wait_for_workers=False)


def main(argv: Sequence[str] | None = None) -> int:
    args: ServerArgs = parse_args(argv)
    from gspo_megatron.cpu_server.http_front import Front, make_server
    from gspo_megatron.cpu_server.rank_loop import IDLE_TIMEOUT, run_worker

    print(f"[cpu_server] CPU stand-in for sglang.launch_server (not an inference server): {vars(args)}", flush=True)
    stopping = threading.Event()
    signalled = []

    def on_signal(signum, frame):
        signalled.append(signum)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    server = store = None  # store: held (and serving the ranks' rendezvous) until this process exits
    if args.node_rank == 0:
        try:
            server = make_server(None, args.host, args.port)  # bind now: a busy port fails at once
        except OSError as e:
            print(f"[cpu_server] cannot listen on {args.host}:{args.port}: {e}", flush=True)
            return 1
        try:
            store = _rendezvous_store(args, IDLE_TIMEOUT)
        except Exception as e:  # noqa: BLE001 (torch raises RuntimeError / DistNetworkError)
            print(f"[cpu_server] cannot host the TP rendezvous at {args.dist_init_addr}: {e}", flush=True)
            server.server_close()
            return 1
        init_addr = f"{store.host}:{store.port}"
    else:
        if not args.dist_init_addr:  # parse_args: required with --nnodes > 1, so on every node_rank > 0
            raise ValueError("--dist-init-addr host:port is required with --nnodes > 1")
        init_addr = args.dist_init_addr
    ctx = mp.get_context("spawn")
    front_conn, worker_conn = ctx.Pipe() if args.node_rank == 0 else (None, None)
    procs = []
    for r in args.local_tp_ranks():
        p = ctx.Process(
            target=run_worker,
            name=f"cpu_server_tp{r}",
            args=(args, r, init_addr, worker_conn if r == 0 else None, os.getpid()),
        )
        p.start()
        procs.append(p)
    print(
        f"[cpu_server] node {args.node_rank}/{args.nnodes}: TP ranks {args.local_tp_ranks()} "
        f"(pids {[p.pid for p in procs]}), rendezvous {init_addr}",
        flush=True,
    )

    code = 0
    front = None
    if server is not None:
        if front_conn is None:  # node 0 (it holds the server) made the pipe
            raise RuntimeError("node 0 has no pipe to TP rank 0")
        ready = None
        while ready is None and not stopping.is_set():
            if front_conn.poll(0.5):
                try:
                    ready = front_conn.recv()
                except EOFError:
                    ready = {"success": False, "message": "TP rank 0 exited during start-up"}
            elif not all(p.is_alive() for p in procs):
                ready = {"success": False, "message": "a TP rank exited during start-up"}
        if ready is None or not ready["success"]:
            print(f"[cpu_server] start-up failed: {ready and ready['message']}", flush=True)
            server.server_close()
            _stop(procs)
            return 1
        front = Front(args, front_conn, on_worker_death=stopping.set)
        server.front_holder[0] = front
        threading.Thread(target=server.serve_forever, daemon=True, name="http").start()
        print(f"[cpu_server] The server is fired up and ready to roll! http://{args.host}:{args.port}", flush=True)

    while not stopping.is_set():
        if not all(p.is_alive() for p in procs):
            print("[cpu_server] a TP process exited; shutting down", flush=True)
            code = 1
            break
        stopping.wait(0.5)
    if server is not None:
        if not signalled:  # a worker died: let the answer in flight (500) reach its client first
            time.sleep(0.5)
        if front is not None:
            front.close_scheduling()
        server.shutdown()
        server.server_close()
    _stop(procs)
    print(f"[cpu_server] stopped ({'signal ' + str(signalled[0]) if signalled else 'exit'})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
