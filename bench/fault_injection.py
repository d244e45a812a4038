"""Fault injection on the CPU demo: kill the rollout engine, a reward worker, or a training rank at
random points, rerun what died, and report what was recovered and what was lost.

    .venv/bin/python bench/fault_injection.py --faults 6 --seed 0 [--nproc 2]

Each trial starts a short demo run (engine in a child process, reward workers with a timeout,
checkpoints every 2 steps) and, after a random delay, injects one fault:

- engine: SIGKILL the engine process. Expected: the trainer restarts it, re-syncs the weights and
  retries the step; the run finishes by itself.
- reward: SIGKILL a reward worker. Expected: the worker is replaced, that call scores 0 and is
  counted; the run finishes by itself.
- trainer: SIGKILL a training rank (torchrun then stops the others). Expected: the same command
  resumes from the newest complete checkpoint.

Reported per trial and in total: faults injected, runs recovered (finished with every step's
metrics row present exactly once and a loadable final checkpoint), steps lost (finished steps
recomputed after a trainer kill = the last logged step minus the resumed checkpoint's step), data lost (missing or
duplicated metrics rows, or no loadable checkpoint), orphan processes (processes of the run -- found by
a marker in their environment, whoever their parent is now -- still alive 20 s after it ended; they
are killed then). Each trial's run directory is removed afterwards (``--keep`` keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from gspo_megatron.runtime.ports import free_port

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
STEPS = 8
OVERRIDES = [
    f"train.steps={STEPS}",
    "checkpoint.interval=2",
    "checkpoint.keep_last=2",
    "rollout.engine_process=true",
    "reward.num_workers=1",
    "reward.timeout_s=5",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "parallel.micro_batch_size=4",
    "logging.progress=false",
    "logging.tensorboard=false",
    "rollout.max_engine_restarts=3",
]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(pid))
    return tree


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        for c in tree.get(pid, []):
            out.append(c)
            todo.append(c)
    return out


def find_targets(root: int) -> dict[str, list[int]]:
    """Processes of a run by role: training ranks, engine children, reward workers."""
    procs = _descendants(root)
    roles: dict[str, list[int]] = {"trainer": [], "engine": [], "reward": []}
    forkservers = {p for p in procs if "forkserver" in cmdline(p)}
    for p in procs:
        cmd = cmdline(p)
        parent = _parent(p)
        if parent in forkservers:
            roles["engine"].append(p)  # the rollout engine is forked from a forkserver
        elif "spawn_main" in cmd:
            roles["reward"].append(p)
        elif "gspo_megatron.train" in cmd and "torch.distributed.run" not in cmd:
            roles["trainer"].append(p)
    if "gspo_megatron.train" in cmdline(root) and "torch.distributed.run" not in cmdline(root):
        roles["trainer"].append(root)
    return roles


def marked_processes(key: str, value: str) -> list[int]:
    """Live processes (zombies excluded) whose environment holds ``key=value``: every process of a
    run started with that variable, forked or spawned, whoever its parent is now."""
    needle = f"{key}={value}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:  # gone, or not ours
            continue
        found.append(int(pid))
    return found


def kill_marked(key: str, value: str) -> list[int]:
    """SIGKILL every process ``marked_processes(key, value)`` finds; returns their pids."""
    pids = marked_processes(key, value)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def command(out_dir: str, nproc: int) -> list[str]:
    args = [
        "-m",
        "gspo_megatron.train",
        "--config",
        os.path.join(REPO, "configs/demo_cpu.yaml"),
        f"output_dir={out_dir}",
        *OVERRIDES,
    ]
    if nproc > 1:
        port = free_port()
        args = [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={port}",
            *args,
            "parallel.ep=2",
        ]
    return [sys.executable, *args]


def metrics_steps(out_dir: str) -> list[int]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def latest_step(out_dir: str) -> int:
    sys.path.insert(0, REPO)
    from gspo_megatron.checkpoint.manager import latest_checkpoint, read_meta

    path = latest_checkpoint(os.path.join(out_dir, "checkpoints"))
    return int(read_meta(path)["step"]) if path else 0


MARK = "GSPO_FAULT_TRIAL"


def leftovers(marker: str, grace_s: float = 20.0) -> list[int]:
    """Processes of a finished (or killed) run still alive after ``grace_s`` seconds."""
    deadline = time.time() + grace_s
    alive = marked_processes(MARK, marker)
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = marked_processes(MARK, marker)
    return alive


def trial(kind: str, rng: random.Random, nproc: int, log, out_dir: str | None = None) -> dict:
    """One run with one fault, in ``out_dir`` (default: a new temporary directory, which the caller
    removes). ``orphans``: processes of the run still alive after it ended (killed afterwards)."""
    out_dir = out_dir or tempfile.mkdtemp(prefix=f"fault-{kind}-")
    marker = uuid.uuid4().hex
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **{MARK: marker})
    try:
        return _trial(kind, rng, nproc, log, out_dir, env, marker)
    finally:
        kill_marked(MARK, marker)  # whatever happened, nothing of this trial keeps running


def _trial(kind: str, rng: random.Random, nproc: int, log, out_dir: str, env: dict, marker: str) -> dict:
    proc = subprocess.Popen(command(out_dir, nproc), cwd=REPO, env=env, stdout=log, stderr=log, start_new_session=True)
    injected, killed_at, deadline = False, None, time.time() + 900
    target_step = rng.randint(2, STEPS - 2)
    while proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
        if injected or not metrics_steps(out_dir) or max(metrics_steps(out_dir)) < target_step:
            continue
        victims = find_targets(proc.pid)[kind]
        if victims:
            time.sleep(rng.uniform(0.0, 1.0))  # land anywhere inside the next step
            killed_at = max(metrics_steps(out_dir) or [0])
            os.kill(rng.choice(victims), signal.SIGKILL)
            injected = True
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    orphans = [cmdline(p)[:120] for p in leftovers(marker)]  # what outlived the (killed) run
    try:  # the group outlives its root while any member lives
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    kill_marked(MARK, marker)
    first_rc, resumed_from, steps_lost = proc.returncode, None, 0
    if kind == "trainer" and injected:
        time.sleep(1.0)
        resumed_from = latest_step(out_dir)
        steps_lost = max(0, (killed_at or 0) - resumed_from)  # finished steps redone after resume
        rerun = subprocess.run(command(out_dir, nproc), cwd=REPO, env=env, stdout=log, stderr=log, timeout=900)
        final_rc = rerun.returncode
        orphans += [cmdline(p)[:120] for p in leftovers(marker)]
    else:
        final_rc = first_rc
    steps = metrics_steps(out_dir)
    data_lost = steps != list(range(1, STEPS + 1)) or latest_step(out_dir) != STEPS
    return dict(
        kind=kind,
        out_dir=out_dir,
        injected=injected,
        killed_after_step=killed_at,
        first_exit=first_rc,
        final_exit=final_rc,
        recovered=final_rc == 0 and not data_lost,
        resumed_from_step=resumed_from,
        steps_lost=steps_lost,
        data_lost=data_lost,
        orphans=orphans,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=3, help="number of trials (one fault each)")
    parser.add_argument("--kinds", default="engine,reward,trainer")
    parser.add_argument("--nproc", type=int, default=1, help="training ranks (2: torchrun, EP2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "fault_injection.log"))
    parser.add_argument("--keep", action="store_true", help="keep each trial's run directory")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    results = []
    with open(args.log, "w") as log:
        for i in range(args.faults):
            r = trial(kinds[i % len(kinds)], rng, args.nproc, log)
            if not args.keep:
                shutil.rmtree(r["out_dir"], ignore_errors=True)
            results.append(r)
            print(json.dumps(r), flush=True)
    injected = sum(r["injected"] for r in results)
    orphans = sum(len(r["orphans"]) for r in results)
    print(
        f"\nfaults injected: {injected}/{len(results)}  runs recovered: {sum(r['recovered'] for r in results)}"
        f"  steps lost: {sum(r['steps_lost'] for r in results)}  "
        f"data lost: {sum(r['data_lost'] for r in results)} runs  orphan processes: {orphans}   (log: {args.log})"
    )
    return 0 if all(r["recovered"] and not r["orphans"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
