"""Which host a CPU-server process is on, and the rule that a shared-memory segment opens only there.

Several nodes are simulated on one machine in tests (``torchrun --nnodes N --node-rank K`` launches,
or ``GSPO_SIM_HOST``); a CPU tensor pickled by ForkingPickler's ``file_system`` strategy travels as the
name of a segment in its host's ``/dev/shm``, which a process on another node cannot open (what sglang's
TP ranks on another node meet). :func:`segments_of_host` makes a deserialization fail as it would there.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator

SIM_HOST_ENV = "GSPO_SIM_HOST"  # a process's simulated host (tests); else torchrun's GROUP_RANK
_SEGMENT = re.compile(rb"^/torch_(\d+)_")  # torch's shared-memory segment name: /torch_<creator pid>_...


def simulated_host(pid: int) -> str | None:
    """The host of process ``pid`` (None: no such process): this machine's name, plus the simulated
    node when several are simulated on it (``GSPO_SIM_HOST``, else torchrun's ``GROUP_RANK``, of ``pid``
    or of its nearest ancestor that has one: an engine's processes are on the node of the training
    rank that launched them)."""
    import socket

    import psutil

    host = socket.gethostname()
    try:
        p: Any = psutil.Process(pid)
    except psutil.Error:
        return None
    while p is not None:
        try:
            env = p.environ()
            p = p.parent()
        except psutil.Error:
            break
        for key in (SIM_HOST_ENV, "GROUP_RANK"):
            if env.get(key):
                return f"{host}/node{env[key]}"
    return host


@contextlib.contextmanager
def segments_of_host(host: str) -> Iterator[None]:
    """Inside, a payload's CPU tensor in a shared-memory segment (ForkingPickler's ``file_system``
    form: ``rebuild_storage_filename(cls, manager, b"/torch_<pid>_...", size)``) is opened only when its
    creator is on ``host``: a segment is a file of its host's ``/dev/shm``, which no other node can
    open (sglang's TP ranks on another node fail there). Tensors pickled by value are unaffected."""
    import torch.multiprocessing.reductions as red

    real = red.rebuild_storage_filename

    def checked(cls, manager, handle, size, dtype=None):
        m = _SEGMENT.match(handle if isinstance(handle, bytes) else str(handle).encode())
        creator = simulated_host(int(m.group(1))) if m is not None else None
        if creator is not None and creator != host:
            raise FileNotFoundError(
                f"shared-memory segment {handle!r} was created on host {creator!r}; this TP rank runs on "
                f"{host!r} and cannot open it (send the tensors by value)"
            )
        return real(cls, manager, handle, size, dtype)

    red.rebuild_storage_filename = checked  # looked up by name while unpickling (SafeUnpickler.find_class)
    try:
        yield
    finally:
        red.rebuild_storage_filename = real
