"""Child processes that die with the trainer, also when the trainer is killed by SIGKILL.

A SIGKILLed process runs no cleanup: its children are re-parented (to PID 1 or a subreaper) and
live on, holding GPU memory, ports and files (on a GPU node they can block the restarted job). Only
the kernel and the children themselves can notice. Three mechanisms, all Linux:

- ``die_with_parent(parent_pid)``, called in the child: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks
  the kernel to SIGKILL this process when its parent exits. The kernel's "parent" is the *thread*
  that forked the child, so children must be started from a thread that lives as long as the
  process (the main thread). A parent that died before the call is caught by comparing
  ``os.getppid()`` with ``parent_pid`` (the child was re-parented: it kills itself at once).
- ``run_dying_with_parent(target, *args)``: the ``target`` of a multiprocessing child (spawn or
  forkserver). Besides PR_SET_PDEATHSIG (the direct parent: the trainer for spawn, the fork server
  for forkserver) a daemon thread waits on ``multiprocessing.parent_process().sentinel``, a pipe
  whose write end only the starting process holds: it reaches EOF when the *starting* process dies,
  whoever the kernel parent is. So a forkserver child dies with the trainer, not with the server.
- ``dying_with_this_process(argv)``: ``subprocess.Popen(dying_with_this_process(argv), ...)`` (SGLang
  servers, the CPU rollout server): the child first runs a few lines of stdlib Python that set
  PR_SET_PDEATHSIG and then ``exec`` the real command (the flag survives exec of a non-setuid
  program). Works together with ``start_new_session=True``. Not a ``preexec_fn``: Python code
  between fork and exec can deadlock on CPython 3.11 when any other thread of the trainer is
  creating a Python thread state at that moment (a C++ thread calling into Python: the child's
  ``PyOS_AfterFork_Child`` waits forever on the runtime's thread-list lock, which that thread held
  at the fork). Seen as an engine that never started in a multi-node run under load; reproduced
  in ``tests/test_children.py``. Without ``preexec_fn`` ``subprocess`` uses vfork + exec and runs no
  Python in the child.
- ``die_with_launcher()``: first thing in a rank under torchrun: the rank dies with the agent.

Megatron's own checkpoint writer (``dist_checkpointing.save`` with the torch_dist strategy) starts
processes we do not create: on the first save, ``filesystem_async._get_write_results_queue`` spawns
a ``multiprocessing`` Manager server (kept for the life of the trainer; with it the spawn machinery
starts multiprocessing's resource tracker), and every save forks ``thread_count`` writer processes.
``checkpoint.manager.write_checkpoint_dir`` writes through ``checkpoint.writer`` instead (threads of this
process: none of these); only where that writer does not apply (a multi-storage client) does
Megatron's run, and then ``adopt_checkpoint_writers()`` (every rank, before a save; idempotent)
covers both: it starts that Manager itself with ``die_with_parent`` as the server's initializer
and stores its queue where Megatron looks for it, and it installs ``os.register_at_fork`` hooks so
that every child forked from the main thread of this process (Megatron's writers included) gets
PR_SET_PDEATHSIG. The resource tracker needs nothing: it exits by itself (after unlinking leaked
semaphores / shared memory) once every process holding its pipe -- the trainer and its spawned
children -- is gone.

Not covered: children forked from a non-main thread (the hook skips them: they would die when that
thread ends) and processes that call ``setsid`` and double-fork away on their own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from multiprocessing.managers import SyncManager

PR_SET_PDEATHSIG = 1
PR_GET_PDEATHSIG = 2

# Resolved once at import, so that the child between fork and exec only makes the call.
_libc = (
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if sys.platform.startswith("linux")
    else None
)


def _prctl(option: int, arg: int) -> int:
    assert _libc is not None  # Linux only: the callers check
    return _libc.prctl(option, ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def parent_death_signal() -> int:
    """This process's parent-death signal (0: none). Linux only."""
    if _libc is None:
        return 0
    sig = ctypes.c_int(0)
    _libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(sig), 0, 0, 0)
    return sig.value


def die_with_parent(parent_pid: int | None = None) -> None:
    """In a child: be SIGKILLed by the kernel when the parent (the thread that forked us) exits.
    If ``parent_pid`` is given and our parent is no longer that process (it died before this call
    and we were re-parented), SIGKILL ourselves now. A no-op off Linux."""
    if _libc is None:
        return
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> bool:
    """First thing in a training rank's main under torchrun (``TORCHELASTIC_RUN_ID`` set): the rank
    dies with the torchrun agent that started it, also when the agent is SIGKILLed (torchrun itself
    does not ask for this). Returns whether it applied."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or _libc is None:
        return False
    die_with_parent(os.getppid())
    return True


# Runs in the child, before the real command: stdlib only (python -I -S: no site, no env), so
# it starts in milliseconds. argv: <signal> <parent pid> <command...>.
_EXEC_DYING_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, ctypes.c_ulong(int(sys.argv[1])), ctypes.c_ulong(0),"
    " ctypes.c_ulong(0), ctypes.c_ulong(0))\n"
    "if os.getppid() != int(sys.argv[2]):\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def dying_with_this_process(argv: Sequence[str], sig: int = signal.SIGKILL) -> list[str]:
    """The command line that runs ``argv`` in a child that gets ``sig`` when this process exits
    (PR_SET_PDEATHSIG, set by a small stdlib-only Python prelude that then ``exec``s ``argv``; the
    child's pid and process group are those of ``argv``'s process; a child whose parent died
    before the prelude ran is SIGKILLed at once). Pass it to ``subprocess.Popen`` from the main
    thread (PR_SET_PDEATHSIG fires when the forking *thread* ends), else RuntimeError. Off Linux
    ``argv`` is returned unchanged."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "dying_with_this_process(): start child processes from the main thread (the "
            "kernel would kill them when the starting thread ends)"
        )
    if _libc is None:
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _EXEC_DYING_WITH_PARENT, str(int(sig)), str(os.getpid()), *argv]


def _watch_parent_sentinel() -> None:
    """Daemon thread of a multiprocessing child: SIGKILL this process when the process that
    started it (``multiprocessing.parent_process()``) is gone."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return

    def watch():
        from multiprocessing.connection import wait

        wait([parent.sentinel])  # readable only at EOF: the starting process has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="gspo-parent-watch", daemon=True).start()


def run_dying_with_parent(target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``Process(target=run_dying_with_parent, args=(fn, *fn_args))``: ``fn(*fn_args)`` in a child
    that dies with the process that started it (see the module docstring)."""
    die_with_parent()
    _watch_parent_sentinel()
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive():  # died before the watch began
        os.kill(os.getpid(), signal.SIGKILL)
    return target(*args, **kwargs)


# -- children forked by libraries (Megatron's checkpoint writers) ---------------------------------
_fork_state = threading.local()
_fork_hooks_installed = False


def _before_fork() -> None:
    _fork_state.main = threading.current_thread() is threading.main_thread()
    _fork_state.pid = os.getpid()


def _after_fork_in_child() -> None:
    if getattr(_fork_state, "main", False):
        die_with_parent(_fork_state.pid)


def install_fork_hooks() -> None:
    """Every later ``os.fork()`` made by this process's main thread (multiprocessing's fork start
    method included) gives the child PR_SET_PDEATHSIG. Idempotent."""
    global _fork_hooks_installed
    if _fork_hooks_installed or _libc is None:
        return
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
    _fork_hooks_installed = True


_writer_manager: SyncManager | None = None


def adopt_checkpoint_writers() -> None:
    """Make the processes of Megatron's dist_checkpointing writer die with this process (every rank
    calls it before ``dist_checkpointing.save``; idempotent; see the module docstring)."""
    global _writer_manager
    install_fork_hooks()
    if _writer_manager is not None or _libc is None:
        return
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        return
    if getattr(fa, "_results_queue", "absent") is not None:
        return  # not this megatron-core's layout, or already created (not by us)
    if threading.current_thread() is not threading.main_thread():
        return  # the manager would die with this thread; leave it to Megatron
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # as Megatron: spawn
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    fa._results_queue = manager.Queue()
    _writer_manager = manager


def writer_manager_pid() -> int | None:
    """PID of the Manager server started by ``adopt_checkpoint_writers`` (None before)."""
    # (BaseManager._process: private, not in typeshed)
    return None if _writer_manager is None else _writer_manager._process.pid  # type: ignore[attr-defined]
