"""``distill.*``: on-policy distillation. Teachers (sglang servers of their own) score every sampled
token of the student's rollouts by prefill (``distill/teachers.py``); the loss adds
``distill.coef * J_token(A^d)`` to the policy's (``losses/distill_loss.py``).

Placement: a ``NAME=URL,...`` teacher runs on nodes of its own (the launch script starts it,
``launch/slurm/train.sbatch`` with ``TEACHER_MODEL``); a ``NAME=HF_DIR`` teacher is started by rank 0 on
its node, on the training GPUs with ``distill.teacher_mem_fraction`` of each GPU it spans, and its
memory is released while the student trains (sglang's ``/release_memory_occupation``, as colocated
student engines do). The planner counts the started teachers' share on the training GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gspo_megatron.features.base import GIB, Feature, PlanContext, Row, floor2


@dataclass(frozen=True)
class TeacherSpec:
    """One entry of ``distill.teachers``: ``urls`` (running servers) or ``model_path`` (started here)."""

    name: str
    urls: tuple[str, ...] = ()
    model_path: str | None = None

    @property
    def started_here(self) -> bool:
        return self.model_path is not None


def parse_teachers(entries: list[str]) -> tuple[list[TeacherSpec], list[str]]:
    """(teachers, errors) of ``distill.teachers``: each 'NAME=URL[,URL...]' or 'NAME=HF_DIR'."""
    out: list[TeacherSpec] = []
    errors: list[str] = []
    for i, entry in enumerate(entries):
        name, sep, value = str(entry).partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value:
            errors.append(
                f"distill.teachers[{i}]={entry!r} must be 'NAME=URL[,URL...]' (running teacher servers) or "
                "'NAME=HF_DIR' (a teacher this run starts), e.g. 'math=http://10.0.0.5:30000'"
            )
            continue
        if any(t.name == name for t in out):
            errors.append(f"distill.teachers[{i}]: the name {name!r} is given twice; each teacher needs its own name")
            continue
        if value.startswith(("http://", "https://")):
            urls = tuple(u.strip().rstrip("/") for u in value.split(",") if u.strip())
            bad = [u for u in urls if not u.startswith(("http://", "https://"))]
            if bad:
                errors.append(f"distill.teachers[{i}] ({name}): {bad[0]!r} is not an http(s) URL")
                continue
            out.append(TeacherSpec(name, urls=urls))
        else:
            out.append(TeacherSpec(name, model_path=value))
    return out, errors


def _objective_needs_topk(name: str) -> bool | None:
    """Whether ``distill.loss`` ``name`` is a top-k objective (None: not registered; the loader says so)."""
    from gspo_megatron.losses.distill_loss import DISTILL_LOSSES

    return DISTILL_LOSSES[name].topk if name in DISTILL_LOSSES else None


class Distill(Feature):
    name = "distill"
    field = "distill.teachers"
    metrics = (
        "distill/reverse_kl",
        "distill/clip_frac",
        "distill/teacher_score_s",
        "distill/tokens",
        "perf/teacher_wait_s",
    )  # and distill/reverse_kl/<teacher>

    def enabled(self, cfg) -> bool:
        return bool(cfg.distill.teachers)

    def config_errors(self, cfg) -> list[str]:
        d = cfg.distill
        e = []
        for name in ("coef", "reward_coef"):
            v = getattr(d, name)
            if not (math.isfinite(v) and v >= 0):
                e.append(f"distill.{name} must be a finite value >= 0, got {v}")
        if d.coef > 0 and not d.teachers:
            e.append(f"distill.coef={d.coef} needs a teacher: distill.teachers ['NAME=URL[,URL...]' or 'NAME=HF_DIR']")
        if d.reward_coef == 0 and d.coef == 0:
            e.append(
                "distill.reward_coef=0 with distill.coef=0 leaves nothing to learn; set distill.coef > 0 (e.g. 1.0)"
            )
        for name, lo in (("engines_per_teacher", 1), ("teacher_tp", 1), ("batch_size", 1)):
            if getattr(d, name) < lo:
                e.append(f"distill.{name} must be >= {lo}, got {getattr(d, name)}")
        if not (0 < d.teacher_mem_fraction < 1):
            e.append(f"distill.teacher_mem_fraction must be in (0, 1), got {d.teacher_mem_fraction}")
        if not (math.isfinite(d.timeout_s) and d.timeout_s > 0):
            e.append(f"distill.timeout_s must be a finite value > 0, got {d.timeout_s}")
        if d.topk < 0:
            e.append(f"distill.topk must be >= 0, got {d.topk}")
        needs_topk = _objective_needs_topk(d.loss)
        if needs_topk and d.topk < 1:
            e.append(f"distill.loss={d.loss} compares with the teacher's top-k tokens: set distill.topk >= 1 (e.g. 8)")
        if d.topk > 0 and needs_topk is False:
            e.append(
                f"distill.topk={d.topk} is read only by the top-k objectives; distill.loss={d.loss} uses none (set 0)"
            )
        teachers, errors = parse_teachers(d.teachers)
        e += errors
        if len(teachers) > 1 and not d.teacher_key:
            names = ", ".join(t.name for t in teachers)
            e.append(
                f"distill.teachers has {len(teachers)} teachers ({names}): distill.teacher_key must name the data "
                "column that routes each prompt to one of them"
            )
        if d.teacher_key and not d.teachers:
            e.append(f"distill.teacher_key={d.teacher_key!r} routes prompts to teachers, but distill.teachers is empty")
        if d.teacher_key and cfg.data.path is None:
            e.append(
                f"distill.teacher_key={d.teacher_key!r} reads a data column; the built-in data.task "
                f"{cfg.data.task!r} has none: use a data.path file with that column, or leave teacher_key null"
            )
        if d.teacher_key and d.teacher_key in (cfg.data.prompt_key, cfg.data.label_key):
            e.append(f"distill.teacher_key={d.teacher_key!r} is also the prompt or label column; name its own column")
        return e

    def _teacher_row(self, ctx: PlanContext) -> list[Row]:
        """Started teachers span ``teacher_tp`` GPUs of rank 0's node each (its GPUs 0.., global
        ranks 0..: distill/teacher_servers.py) and hold ``teacher_mem_fraction`` of each while
        generating (released while the student trains); a pipeline stage whose first rank is beyond
        them holds none."""
        d, p = ctx.cfg.distill, ctx.cfg.parallel
        started = [t for t in parse_teachers(d.teachers)[0] if t.started_here]
        gpus = len(started) * d.engines_per_teacher * d.teacher_tp
        if not started or ctx.engine_gpu or gpus > ctx.gpus_per_node:  # (notes() says it does not fit)
            return []
        if ctx.stage * p.tp * p.cp * ctx.dp >= gpus:
            return []
        label = f"distill teachers ({len(started)} started, mem_fraction {d.teacher_mem_fraction})"
        return [(label, d.teacher_mem_fraction * ctx.gpu_bytes)]

    def train_rows(self, ctx: PlanContext) -> list[Row]:
        """Engines elsewhere: the training state stays resident while the teachers score, so their
        share is counted with it (an over-count by the activations, which are freed by then)."""
        return [] if ctx.colocated else self._teacher_row(ctx)

    def rollout_rows(self, ctx: PlanContext, kv_tokens: float) -> list[Row]:
        """Colocated engines: the teachers' share is part of the rollout phase."""
        return self._teacher_row(ctx) if ctx.colocated else []

    def rollout_advice(self, cfg, over_fraction: float) -> list[str]:
        """Teachers started here take ``teacher_mem_fraction`` of their GPUs while rolling out
        (:meth:`_teacher_row`): a smaller share, or their own nodes."""
        d = cfg.distill
        if not any(t.started_here for t in parse_teachers(d.teachers)[0]):
            return []
        tips = []
        if d.teacher_mem_fraction - over_fraction > 0:
            tips.append(f"distill.teacher_mem_fraction <= {floor2(d.teacher_mem_fraction - over_fraction)}")
        return tips + ["serve the teachers from their own nodes (distill.teachers NAME=URL)"]

    def notes(self, ctx: PlanContext) -> list[str]:
        d = ctx.cfg.distill
        teachers = parse_teachers(d.teachers)[0]
        started = [t for t in teachers if t.started_here]
        out = []
        if started:
            gpus = len(started) * d.engines_per_teacher * d.teacher_tp
            out.append(
                f"distill: {len(started)} teacher(s) started on rank 0's node: {gpus} GPU(s) at "
                f"{d.teacher_mem_fraction:.2f} of {ctx.gpu_bytes / GIB:.0f} GiB each while rolling out"
                + (f"; more than the node's {ctx.gpus_per_node} GPUs" if gpus > ctx.gpus_per_node else "")
            )
        remote = [t.name for t in teachers if not t.started_here]
        if remote:
            out.append(f"distill: teachers on their own servers (not counted here): {', '.join(remote)}")
        return out


DISTILL = Distill()
