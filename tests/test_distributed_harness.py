"""The multi-rank harness never hangs: ranks stuck past the deadline are killed and the test fails
with each rank's Python stacks; a failing rank's traceback reaches the parent."""

import os
import time

import psutil
import pytest

from distributed_harness import RanksTimedOut, run_ranks


def _stuck_in_a_collective(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if rank == 1:
        time.sleep(3600)  # rank 0 waits in the barrier for a peer that never comes
    dist.barrier()


def _raises(rank, world):
    if rank == 1:
        raise ValueError("rank one is broken")
    return rank


def _session_helper(p: psutil.Process) -> bool:
    """multiprocessing's resource tracker or the harness's fork server: this process's own children,
    started with the first call, that stay for the session. The ranks the fork server forks carry its
    command line too, but are its children, so they still count."""
    cmd = " ".join(p.cmdline())
    return p.ppid() == os.getpid() and ("resource_tracker" in cmd or "forkserver" in cmd)


def _ranks_alive(before: set[int]) -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before and not _session_helper(p)]


def test_a_deadlock_fails_with_every_ranks_stacks_and_kills_them():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # 15 s is ample for 2 ranks to start on an idle machine; on a busy one the ranks may not have
    # reached their places by then (rank 0 still in init_process_group): then once more with 45 s
    for timeout in (15, 45):
        with pytest.raises(RanksTimedOut) as e:
            run_ranks(_stuck_in_a_collective, 2, timeout=timeout)
        text = str(e.value)
        assert _ranks_alive(before) == []
        if "in barrier" in text.split("--- rank 0")[1].split("--- rank 1")[0]:
            break
    assert f"did not finish in {timeout}s" in text
    rank0, rank1 = text.split("--- rank 0")[1].split("--- rank 1")
    assert "in barrier" in rank0  # rank 0 waits in the collective
    assert "in _stuck_in_a_collective" in rank1 and "in barrier" not in rank1  # rank 1 never got there
    assert _ranks_alive(before) == []


def test_a_failing_rank_reports_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank one is broken"):
        run_ranks(_raises, 2, timeout=600)


class _SlowToSave:
    """Pickling it (in torch.save) marks ``marker`` and then takes a minute: the rank is in the
    middle of writing its result file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        open(self.marker, "w").close()
        time.sleep(60)
        return (_SlowToSave, (self.marker,))


def _raises_while_rank0_saves(rank, world, marker):
    if rank == 1:
        while not os.path.exists(marker):  # rank 0 has begun writing its result
            time.sleep(0.05)
        raise ValueError("rank one is broken")
    return _SlowToSave(marker)


def test_a_rank_killed_while_saving_its_result_leaves_the_failure_readable(tmp_path):
    """A rank failing makes join() terminate the others, maybe in the middle of writing their result
    file; the parent still reports the failing rank's traceback, not a half-written file."""
    with pytest.raises(RuntimeError, match="(?s)rank one is broken"):
        run_ranks(_raises_while_rank0_saves, 2, str(tmp_path / "saving"), timeout=600)
