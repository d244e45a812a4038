"""gspo_megatron/runtime/children.py: each way a child is started dies with its starter when the
starter is SIGKILLed (a Popen'd program, a forkserver child, a forked child, Megatron's checkpoint
writer Manager with multiprocessing's resource tracker, a rank under a torchrun-like launcher), and a forked child without the hooks does
not (the control: the check can fail).

Each case runs a small starter script in its own process; the script starts the children, prints
their pids and sleeps; the test SIGKILLs it and looks for any live process carrying the case's
environment marker. Leftovers are killed at the end of every case.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import fault_injection  # noqa: E402

PRELUDE = """
import multiprocessing as mp, os, subprocess, sys, time
from gspo_megatron.runtime import children

def sleeper():
    time.sleep(600)

def report(*pids):
    print(" ".join(str(p) for p in pids), flush=True)
"""

CASES = {  # the body of main() in the starter script
    "popen": """
proc = subprocess.Popen(children.dying_with_this_process([sys.executable, "-c", "import time; time.sleep(600)"]),
                        start_new_session=True)
report(proc.pid)
""",
    "forkserver": """
p = mp.get_context("forkserver").Process(target=children.run_dying_with_parent, args=(sleeper,), daemon=True)
p.start()
report(p.pid)
""",
    "spawn": """
p = mp.get_context("spawn").Process(target=children.run_dying_with_parent, args=(sleeper,), daemon=True)
p.start()
report(p.pid)
""",
    "fork_hook": """
children.install_fork_hooks()
p = mp.get_context("fork").Process(target=sleeper)
p.start()
report(p.pid)
""",
    "launcher": """
env = dict(os.environ, TORCHELASTIC_RUN_ID="test")
code = "from gspo_megatron.runtime import children; import time; assert children.die_with_launcher(); print(1, flush=True); time.sleep(600)"
proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
proc.stdout.readline()
report(proc.pid)
""",
    "fork_no_hook": """
p = mp.get_context("fork").Process(target=sleeper)
p.start()
report(p.pid)
""",
    "checkpoint_manager": """
children.adopt_checkpoint_writers()
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
fa._get_write_results_queue().put(1)   # Megatron's own accessor returns our queue
report(children.writer_manager_pid())
""",
}


def run_case(name: str, tmp_path):
    """Start the case's script, wait for its children's pids, SIGKILL it; return (pids, alive
    marked processes after up to 20 s)."""
    marker = uuid.uuid4().hex
    script = tmp_path / f"{name}.py"
    body = textwrap.indent(CASES[name].strip(), "    ")
    script.write_text(
        f"{PRELUDE}\ndef main():\n{body}\n\nif __name__ == '__main__':\n    main()\n    time.sleep(600)\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT, GSPO_TEST_MARKER=marker)
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip(), f"{name}: the starter printed nothing (exit {proc.poll()})"
        pids = [int(p) for p in line.split()]
        assert all(psutil.pid_exists(p) for p in pids)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline, alive = time.time() + 20, fault_injection.marked_processes("GSPO_TEST_MARKER", marker)
        while alive and time.time() < deadline:
            time.sleep(0.1)
            alive = fault_injection.marked_processes("GSPO_TEST_MARKER", marker)
        return pids, alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        fault_injection.kill_marked("GSPO_TEST_MARKER", marker)


@pytest.mark.parametrize("name", ["popen", "forkserver", "spawn", "fork_hook", "checkpoint_manager", "launcher"])
def test_child_dies_with_sigkilled_starter(name, tmp_path):
    pids, alive = run_case(name, tmp_path)
    assert alive == [], {p: fault_injection.cmdline(p) for p in alive}


def test_forked_child_without_hooks_outlives_its_starter(tmp_path):
    pids, alive = run_case("fork_no_hook", tmp_path)
    assert pids[0] in alive  # what the hooks prevent (killed by run_case afterwards)


def test_die_with_parent_sets_the_kernel_flag():
    from gspo_megatron.runtime import children

    cmd = [sys.executable, "-c", "from gspo_megatron.runtime import children as c; print(c.parent_death_signal())"]
    out = subprocess.run(
        children.dying_with_this_process(cmd),
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        check=True,
    )
    assert int(out.stdout) == signal.SIGKILL


def test_dying_with_this_process_refuses_other_threads():
    import threading

    from gspo_megatron.runtime import children

    errors = []
    t = threading.Thread(
        target=lambda: errors.append(pytest.raises(RuntimeError, children.dying_with_this_process, ["true"]))
    )
    t.start()
    t.join()
    assert errors and "main thread" in str(errors[0].value)


CHURN = """
import ctypes, subprocess, sys, threading
from gspo_megatron.runtime import children

libc = ctypes.CDLL(None)
callback = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda arg: None)
stop = False

def churn():  # C threads calling into Python, as C++ libraries' threads do: each builds a thread state
    tid = ctypes.c_ulong()
    while not stop:
        libc.pthread_create(ctypes.byref(tid), None, callback, None)
        libc.pthread_join(tid, None)

for _ in range(2):
    threading.Thread(target=churn, daemon=True).start()
for _ in range(int(sys.argv[1])):
    assert subprocess.run(children.dying_with_this_process(["true"])).returncode == 0
stop = True
print("started all")
"""


def test_children_start_while_other_threads_enter_python():
    """A child started while C threads create Python thread states must start: a ``preexec_fn``
    (Python code between fork and exec) deadlocked here on CPython 3.11 in every run (the child
    waits forever on the thread-list lock another thread held at the fork)."""
    out = subprocess.run(
        [sys.executable, "-c", CHURN, "200"],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "started all" in out.stdout, out.stderr[-2000:]
