"""The CPU server's scheduler admits at most ``--max-running-requests`` requests at once, as sglang 0.5.23's
does (``managers/scheduler.py`` ``get_num_allocatable_reqs``): a prefill takes the waiting requests in
arrival order while fewer run, and with no room the step decodes the running ones. Checked on the
scheduler itself with a counting forward (no model)."""

from __future__ import annotations

import torch

from gspo_megatron.cpu_server.generation import Request
from gspo_megatron.cpu_server.scheduler import StepScheduler, new_live

V = 8


def _reqs(n: int, new_tokens: int):
    gen = torch.Generator().manual_seed(0)
    req = Request(
        input_ids=(1, 2),
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        max_new_tokens=new_tokens,
        stop_ids=frozenset(),
        seed=None,
    )
    return [new_live(f"r{i}", req, None, gen) for i in range(n)]


def _run(sched: StepScheduler, n: int, new_tokens: int) -> list[tuple[str, list[str]]]:
    """Every step's kind (prefill / decode) and the requests it ran, until all finished."""
    steps: list[tuple[str, list[str]]] = []
    ran: list[str] = []

    def forward(live, ids, start, keep=1):
        ran.append(live.rid)
        return torch.zeros(keep, V)

    sched.submit(_reqs(n, new_tokens))
    finished = 0
    while finished < n:
        ran.clear()
        waiting_before = len(sched.waiting)
        finished += len(sched.step(forward))
        steps.append(("prefill" if len(sched.waiting) < waiting_before else "decode", list(ran)))
    return steps


def test_at_most_n_requests_run_and_the_rest_wait_in_arrival_order():
    steps = _run(StepScheduler(max_running=2), n=5, new_tokens=3)
    assert steps[0] == ("prefill", ["r0", "r1"])  # two admitted, three wait
    assert steps[1:3] == [("decode", ["r0", "r1"])] * 2  # no room: the running ones decode to their end
    assert steps[3] == ("prefill", ["r2", "r3"])
    assert steps[-1][1] == ["r4"]
    for _, rids in steps:
        assert len(rids) <= 2


def test_without_a_limit_every_waiting_request_is_prefilled_at_once():
    steps = _run(StepScheduler(), n=5, new_tokens=2)
    assert steps[0] == ("prefill", ["r0", "r1", "r2", "r3", "r4"])
    assert steps[1] == ("decode", ["r0", "r1", "r2", "r3", "r4"])


def test_a_limit_below_one_admits_one():
    """sglang's request pool holds ``max(1, N)`` rows (``resolve_max_num_reqs``)."""
    steps = _run(StepScheduler(max_running=0), n=2, new_tokens=1)
    assert steps == [("prefill", ["r0"]), ("prefill", ["r1"])]
