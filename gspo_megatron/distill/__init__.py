"""On-policy distillation: teachers (sglang servers) score the student's own rollouts by prefill
(:mod:`gspo_megatron.distill.teachers`); the objectives are in :mod:`gspo_megatron.losses.distill_loss`;
the config's checks and the planner's rows in :mod:`gspo_megatron.features.distill`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gspo_megatron.features.distill import parse_teachers

if TYPE_CHECKING:
    from gspo_megatron.distill.teachers import TeacherPool


def build_teachers(cfg) -> TeacherPool | None:
    """Rank 0: the run's :class:`~gspo_megatron.distill.teachers.TeacherPool` (the 'NAME=HF_DIR'
    teachers started first), or None without ``distill.teachers``. The teachers were checked at
    start-up (``preflight.check_teachers``: answering, the student's tokenizer)."""
    if not cfg.distill.teachers:
        return None
    from gspo_megatron.distill.teacher_servers import StartedTeachers
    from gspo_megatron.distill.teachers import TeacherPool

    specs = parse_teachers(cfg.distill.teachers)[0]
    started = None
    urls = {t.name: list(t.urls) for t in specs if not t.started_here}
    to_start = [t for t in specs if t.started_here]
    if to_start:
        started = StartedTeachers(cfg, to_start)
        urls.update(started.urls)
    try:
        return TeacherPool(cfg, specs, urls, started=started)
    except BaseException:
        if started is not None:
            started.close()
        raise
