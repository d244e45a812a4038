"""Re-initializing the parallel layout in one process (the conversion tools; tests that read one
checkpoint in several layouts) destroys the previous layout's process groups: Megatron's
destroy_model_parallel only forgets them, and gloo groups left alive made every later collective
slower (runtime/distributed.py _destroy_megatron_groups)."""

from __future__ import annotations

from checkpoint_workers import reinit_groups_job
from distributed_harness import run_ranks


def test_reinitializing_a_layout_does_not_pile_up_process_groups():
    layouts = [dict(tp=2), dict(ep=2), dict(tp=2), dict(ep=2), dict(tp=2)]
    counts = run_ranks(reinit_groups_job, 2, layouts)[0]
    # the same layout registers the same number of groups each time it is set up again
    assert counts[0] == counts[2] == counts[4] and counts[1] == counts[3], counts
