"""Choosing a TCP port that a process started later will listen on.

Whenever a port must be named before the process that binds it exists (an engine's ``--port``, a
torchrun ``--master-port``, SGLang's NCCL port), something else may take it in between. The usual
bind-to-0-and-close picks from the kernel's ephemeral range, which is exactly where every outgoing
connection on the host (gloo pairs, HTTP clients, other jobs' stores) also takes its local port: on a
busy node the chosen port is soon somebody's connection and the server fails with EADDRINUSE.
``free_port`` picks below that range instead, where only explicit binds land, and checks that the
port is bindable now. Where the listener can be created first and its port told afterwards (a
``TCPStore`` on port 0), do that instead: it has no race at all.
"""

from __future__ import annotations

import random
import socket

_LOWEST = 10000  # above the well-known / registered services most hosts run


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux default 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port nobody is bound to on ``host`` now, chosen outside the ephemeral range when the
    kernel leaves room below it (else the kernel's choice). ``0.0.0.0`` checks every interface."""
    host = "" if host == "0.0.0.0" else host
    lo, _ = ephemeral_range()
    if lo - _LOWEST >= 1000:
        rng = random.SystemRandom()
        for _ in range(tries):
            port = rng.randrange(_LOWEST, lo)
            if _bindable(host, port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
