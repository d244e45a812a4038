"""Child processes never outlive the trainer (engine servers, reward workers, checkpoint writers)."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child (e.g. ``subprocess.Popen(preexec_fn=die_with_parent)``): the kernel sends ``sig``
    when the parent dies, also by SIGKILL (Linux prctl PR_SET_PDEATHSIG; a no-op elsewhere). If the
    parent is already gone, exit now."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
