"""Run a command in its own process group and never leave any of it behind.

``run_group(cmd, timeout=..., **popen_kwargs)`` is ``subprocess.run(..., capture_output=True,
text=True)`` except that the command gets a new session, and when it outlives ``timeout`` or the
wait is interrupted (pytest-timeout, Ctrl-C) the WHOLE group is killed: torchrun's ranks, a rollout
engine's child, reward workers. ``subprocess.run`` alone kills only the direct child. On a timeout it
raises ``subprocess.TimeoutExpired`` with the output so far.

``popen_group(cmd, **popen_kwargs)``: a context manager around ``subprocess.Popen`` (new session)
that kills the group on exit, for tests that interact with a running command.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)


def run_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    kwargs.setdefault("text", True)
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    except BaseException:
        kill_group(proc)
        raise
    kill_group(proc)  # the command is done; anything it left running in its group goes too
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@contextlib.contextmanager
def popen_group(cmd: list[str], **kwargs):
    proc = subprocess.Popen(cmd, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        kill_group(proc)
