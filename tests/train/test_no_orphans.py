"""No process outlives a SIGKILLed trainer: the rollout engine (forkserver child), the fork server,
the reward worker and multiprocessing's resource tracker all end when `gspo-train` is killed with
SIGKILL (checkpoints are written by the trainer itself: gspo_megatron/checkpoint/writer.py)

- during generation (between a finished checkpoint and the next step's first reward call),
- inside a reward call (the user's reward function sleeps; it reports its pid),
- inside a checkpoint save (the step's ``*.tmp-*`` directory exists, not yet renamed).

Every process of the run carries a marker in its environment (set in the trainer's environment,
inherited by every child, forked or spawned); after the kill no live process may carry it. The
trainer's descendants are also recorded just before the kill, to show that there were children to
kill. Whatever happens, nothing marked is left running (``finally``).
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from train_utils import REPO, train_cmd, train_env

sys.path.insert(0, os.path.join(REPO, "bench"))

import fault_injection

REWARD_SRC = """
import multiprocessing
import os
import time

def score(prompt, response, label):
    with open(os.environ["GSPO_TEST_REWARD_LOG"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    sleep_file = os.environ.get("GSPO_TEST_REWARD_SLEEP")
    if sleep_file and multiprocessing.parent_process() is not None:  # in a reward worker
        with open(sleep_file, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    return float(len(response) % 2)
"""

PROMPTS, GROUP = 4, 4


def start_trainer(tmp_path, marker: str, extra_env: dict, max_new_tokens: int = 3):
    reward = tmp_path / "slow_reward.py"
    reward.write_text(REWARD_SRC)
    out = tmp_path / "run"
    cmd = train_cmd(
        str(out),
        [
            "train.steps=50",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}",
            f"rollout.max_new_tokens={max_new_tokens}",
            f"model.max_seq_len={40 + max_new_tokens}",
            "rollout.dynamic_sampling=false",
            "parallel.micro_batch_size=4",
            "gspo.mini_batches=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            "checkpoint.interval=1",
            "checkpoint.keep_last=2",
            "rollout.engine_process=true",
            "reward.num_workers=1",
            f"reward.function={reward}:score",
            "reward.timeout_s=900",
        ],
    )
    env = dict(
        train_env(),
        GSPO_TEST_MARKER=marker,
        GSPO_TEST_REWARD_LOG=str(tmp_path / "reward_calls.log"),
        **extra_env,
    )
    log = open(tmp_path / "train.log", "w")  # closed by the caller via proc
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, out, log


def wait_for(cond, proc, what: str, timeout: float = 300, poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")


def reward_calls(tmp_path, trainer_pid: int) -> int:
    """Calls made by the reward workers (the trainer's own pre-flight call, which checks the
    function before the model is built, is left out)."""
    path = tmp_path / "reward_calls.log"
    pids = path.read_text().split() if path.exists() else []
    return sum(pid != str(trainer_pid) for pid in pids)


def complete_steps(out) -> list[int]:
    return sorted(
        int(p.rsplit("_", 1)[1])
        for p in glob.glob(str(out / "checkpoints" / "step_*"))
        if ".tmp-" not in p and os.path.exists(os.path.join(p, "COMPLETE"))
    )


def kill_and_check(proc, marker: str, tmp_path, grace_s: float = 30.0) -> dict:
    """SIGKILL the trainer; return the descendants seen just before and the marked processes
    still alive after a grace period (PR_SET_PDEATHSIG is immediate; the resource tracker exits at
    EOF of its pipe)."""
    before = {}
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:  # a short-lived child (a checkpoint writer) may end while it is listed
        try:
            before[child.pid] = " ".join(child.cmdline())[:160]
        except psutil.Error:
            before[child.pid] = "(ended while listed)"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.time() + grace_s
    alive = fault_injection.marked_processes("GSPO_TEST_MARKER", marker)
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = fault_injection.marked_processes("GSPO_TEST_MARKER", marker)
    return {"before": before, "alive": {pid: fault_injection.cmdline(pid)[:160] for pid in alive}}


@pytest.fixture
def marker():
    mark = uuid.uuid4().hex
    yield mark
    fault_injection.kill_marked("GSPO_TEST_MARKER", mark)  # never leave anything running


def assert_no_orphans(result, proc, log_path):
    assert result["before"], "the trainer had no child processes when it was killed"
    assert not result["alive"], (
        f"processes outlived the SIGKILLed trainer: {result['alive']}\n"
        f"children before the kill: {result['before']}\n" + open(log_path).read()[-3000:]
    )


def test_sigkill_during_generation(tmp_path, marker):
    """The engine is held (SIGSTOP) while step 1 checkpoints, so step 2's generation request is
    pending in it when the trainer is killed; it is released (SIGCONT) just before the kill, so it
    is generating, not stopped, when its parent dies. Without the hold, a fast generation could end
    before the poll sees the checkpoint (CI saw the kill land in step 2's scoring)."""
    proc, out, log = start_trainer(tmp_path, marker, {}, max_new_tokens=200)
    engines: list[int] = []
    try:
        step1_save = lambda: glob.glob(str(out / "checkpoints" / "step_000001*"))  # tmp dir or final
        wait_for(step1_save, proc, "step 1's checkpoint save", poll=0.002)
        engines = fault_injection.find_targets(proc.pid)["engine"]
        assert engines, "no engine process found"
        for pid in engines:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: complete_steps(out), proc, "the first checkpoint")
        time.sleep(1.0)  # the trainer moves on to step 2 and waits on the held engine
        calls = reward_calls(tmp_path, proc.pid)
        for pid in engines:
            os.kill(pid, signal.SIGCONT)
        result = kill_and_check(proc, marker, tmp_path)
        # killed after step 1's checkpoint and before step 2's first reward call: in generation
        assert complete_steps(out) == [1] and calls == reward_calls(tmp_path, proc.pid) == PROMPTS * GROUP
    finally:
        for pid in engines:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        log.close()
        if proc.poll() is None:
            proc.kill()
    assert_no_orphans(result, proc, tmp_path / "train.log")


def test_sigkill_during_reward_call(tmp_path, marker):
    sleep_file = tmp_path / "sleeping"
    proc, out, log = start_trainer(tmp_path, marker, {"GSPO_TEST_REWARD_SLEEP": str(sleep_file)})
    try:
        wait_for(lambda: sleep_file.exists() and sleep_file.read_text(), proc, "a sleeping reward call")
        worker = int(sleep_file.read_text())
        assert worker != proc.pid and psutil.pid_exists(worker)  # inside a reward worker, now
        result = kill_and_check(proc, marker, tmp_path)
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
    assert worker in result["before"]
    assert_no_orphans(result, proc, tmp_path / "train.log")


def test_sigkill_during_checkpoint_save(tmp_path, marker):
    proc, out, log = start_trainer(tmp_path, marker, {})
    try:
        wait_for(lambda: complete_steps(out), proc, "the first checkpoint")
        wait_for(
            lambda: glob.glob(str(out / "checkpoints" / "step_*.tmp-*")),
            proc,
            "a checkpoint save in progress",
            poll=0.002,
        )
        result = kill_and_check(proc, marker, tmp_path)
        assert glob.glob(str(out / "checkpoints" / "step_*.tmp-*"))  # the save never finished
    finally:
        log.close()
        if proc.poll() is None:
            proc.kill()
    assert_no_orphans(result, proc, tmp_path / "train.log")
