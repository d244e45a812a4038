"""Start / stop CPU rollout servers (``python -m gspo_megatron.cpu_server``) for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from gspo_megatron.engines.sglang_client import SGLangHttpClient
from gspo_megatron.engines.sglang_engine import wait_until_healthy
from gspo_megatron.runtime import children
from gspo_megatron.runtime.ports import free_port


class CpuServer:
    """One engine (one or more launches: one per simulated node). ``url`` is node 0's."""

    def __init__(
        self,
        model_path: str,
        log_dir: str,
        *,
        tp: int = 1,
        nnodes: int = 1,
        extra: tuple = (),
        port: int | None = None,
        node_env: dict[int, dict[str, str]] | None = None,
    ):
        """``port``: the address to serve at (an engine restarted in place); ``node_env``: extra
        environment of a node's launch (e.g. ``{1: {"GSPO_SIM_HOST": "1"}}``: node 1 on another host)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        dist_addr = f"127.0.0.1:{free_port()}" if nnodes > 1 else None
        for node in reversed(range(nnodes)):  # node 0 last: the others must be up to rendezvous
            cmd = [
                sys.executable,
                "-m",
                "gspo_megatron.cpu_server",
                "--model-path",
                model_path,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--tp-size",
                str(tp),
                *extra,
            ]
            if nnodes > 1:
                cmd += ["--nnodes", str(nnodes), "--node-rank", str(node), "--dist-init-addr", dist_addr]
            log = open(os.path.join(log_dir, f"cpu_server_{self.port}_node{node}.log"), "wb")
            # SIGTERM when the test process dies (the launcher then stops its TP workers), so a
            # killed test run leaves no server behind
            self.procs.append(
                subprocess.Popen(
                    children.dying_with_this_process(cmd, signal.SIGTERM),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, **(node_env or {}).get(node, {})},
                )
            )
        self.log_path = os.path.join(log_dir, f"cpu_server_{self.port}_node0.log")
        self.client = SGLangHttpClient(self.url, timeout_s=600)
        t0 = time.monotonic()
        try:
            wait_until_healthy(self.client, self.procs[-1], 600, self.log_path)
        except Exception:
            self.stop()
            raise
        self.start_s = time.monotonic() - t0

    def pids(self) -> list[int]:
        """Every process of this server (launchers and their TP workers)."""
        out = []
        for p in self.procs:
            out.append(p.pid)
            try:
                with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                pass
        return out

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
