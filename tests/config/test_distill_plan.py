"""Planner (``planner.make_plan``, ``tools/plan.py``) with ``distill.teachers`` (features/distill.py):
a teacher this run starts ('NAME=HF_DIR') holds ``distill.teacher_mem_fraction`` of a training GPU in
the rollout phase (a row, counted in the peak) and is named in a note; a teacher on servers of its own
('NAME=URL,...') adds no row, only a note naming it."""

from __future__ import annotations

import io

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.plan_report import run_plan
from gspo_megatron.planner import GIB, make_plan

RECIPE = "configs/qwen3_30b_a3b_gspo.yaml"  # 2 nodes x 8 GPUs of 80 GB, colocated engines
NODES, GPUS, MEM_GB = 2, 8, 80.0
# room for a teacher beside the student's engines: their KV cache fills to 0.75 of the GPU, not the recipe's 0.85
ROOM = ["rollout.offload_train=true", "rollout.engine_mem_fraction=0.75"]
STARTED = ["distill.teachers=['t=/some/dir']", "distill.coef=1"]
REMOTE = ["distill.teachers=['t=http://10.0.0.5:31000,http://10.0.0.5:31010']", "distill.coef=1"]


def _plan(overrides):
    return make_plan(load_config(RECIPE, overrides, check_files=False), NODES, GPUS, MEM_GB)


def _teacher_rows(plan):
    return [
        (label, b)
        for s in plan.stages
        for label, b in s.rollout_items + s.train_items
        if label.startswith("distill teachers")
    ]


def test_a_started_teacher_holds_its_mem_fraction_in_the_rollout_phase():
    base = _plan(ROOM)
    plan = _plan(ROOM + STARTED)
    assert _teacher_rows(base) == [] and not any(n.startswith("distill") for n in base.notes)
    (row,) = [(label, b) for label, b in plan.stages[0].rollout_items if label.startswith("distill teachers")]
    assert row == ("distill teachers (1 started, mem_fraction 0.2)", pytest.approx(0.2 * MEM_GB * GIB))
    assert _teacher_rows(plan) == [row]  # the rollout phase only: released while the student trains
    assert plan.stages[0].rollout_peak == pytest.approx(base.stages[0].rollout_peak + row[1])
    assert plan.stages[0].train_peak == pytest.approx(base.stages[0].train_peak)
    assert plan.fits
    assert "distill: 1 teacher(s) started on rank 0's node: 1 GPU(s) at 0.20 of 80 GiB each while rolling out" in (
        plan.notes
    )


def test_the_started_teachers_share_follows_the_config():
    plan = _plan(ROOM + STARTED + ["distill.teacher_mem_fraction=0.1", "distill.teacher_tp=2"])
    (row,) = _teacher_rows(plan)
    assert row == ("distill teachers (1 started, mem_fraction 0.1)", pytest.approx(0.1 * MEM_GB * GIB))
    assert any("2 GPU(s) at 0.10 of 80 GiB" in n for n in plan.notes), plan.notes


def test_the_recipe_as_shipped_has_no_room_for_a_started_teacher():
    """The recipe's engines fill 0.85 of the GPU: with a teacher's 0.2 on top the rollout phase does
    not fit (and does without the teacher)."""
    assert _plan([]).fits
    plan = _plan(STARTED)
    assert not plan.fits and plan.worst.rollout_peak > plan.gpu_bytes
    assert plan.worst.rollout_peak == pytest.approx(_plan([]).worst.rollout_peak + 0.2 * MEM_GB * GIB)
    # the advice names the fractions that would fit, and each of them does
    from gspo_megatron.plan_report import _advice

    advice = _advice(plan)
    assert "distill.teacher_mem_fraction <= " in advice and "rollout.engine_mem_fraction <= " in advice, advice
    assert "model.recompute" not in advice  # the training phase fits: no training advice
    assert advice.count("rollout.offload_train") == 1, advice
    for key in ("distill.teacher_mem_fraction", "rollout.engine_mem_fraction"):
        value = advice.split(f"{key} <= ")[1].split(";")[0]
        assert _plan(STARTED + [f"{key}={value}"]).fits, (key, value)


def test_started_teachers_beyond_the_node_add_no_row_and_the_note_says_so():
    plan = _plan(ROOM + STARTED + ["distill.teacher_tp=8", "distill.engines_per_teacher=2"])
    assert _teacher_rows(plan) == []
    assert any(n.startswith("distill: 1 teacher(s) started") and "more than the node's 8 GPUs" in n for n in plan.notes)


def test_a_teacher_on_its_own_servers_adds_no_row_and_is_named_in_a_note():
    base = _plan(ROOM)
    plan = _plan(ROOM + REMOTE)
    assert _teacher_rows(plan) == []
    assert plan.stages[0].rollout_peak == pytest.approx(base.stages[0].rollout_peak)
    assert "distill: teachers on their own servers (not counted here): t" in plan.notes
    assert not any("started on rank 0's node" in n for n in plan.notes)


def test_tools_plan_prints_the_row_and_the_notes():
    buf = io.StringIO()
    mixed = ["distill.teachers=['a=/some/dir','b=http://h:1']", "distill.coef=1", "distill.teacher_key=src"]
    rc = run_plan(RECIPE, ROOM + mixed + ["data.path=/x.jsonl"], NODES, GPUS, MEM_GB, out=buf)
    out = buf.getvalue()
    assert rc == 0, out
    (line,) = [line for line in out.splitlines() if "distill teachers" in line]
    assert line.split()[-1] == "16.00" and "(1 started, mem_fraction 0.2)" in line
    assert "note: distill: 1 teacher(s) started on rank 0's node" in out
    assert "note: distill: teachers on their own servers (not counted here): b" in out


def test_a_started_teacher_is_counted_when_the_student_engines_are_elsewhere():
    """Engines off the training GPUs: the teacher's share is counted with the resident training state."""
    plan = _plan(
        STARTED
        + [
            "rollout.sync_mode=disaggregated",
            "rollout.offload_train=false",
            "rollout.engine_urls=[http://h:30000]",
            "rollout.num_engines=0",
        ]
    )
    assert any(n.startswith("distill: 1 teacher(s) started") for n in plan.notes)  # the note is there
    assert _teacher_rows(plan), "no row for the started teacher on the training GPUs"


def test_only_the_pipeline_stages_on_the_teachers_gpus_hold_them():
    """The started teachers take GPUs 0.. of rank 0's node (global ranks 0..); pipeline is the slowest
    rank dimension, so with pp 2 over 2 nodes of 8 the last stage (ranks 8..15) holds none, and with
    teachers on all 8 GPUs of the node neither does it, while stage 0 always does."""
    plan = _plan(ROOM + STARTED + ["parallel.pp=2"])
    first, last = plan.stages[0], plan.stages[-1]
    assert (first.stage, last.stage) == (0, 1)
    assert [lbl for lbl, _ in first.rollout_items if lbl.startswith("distill teachers")]
    assert not [lbl for lbl, _ in last.rollout_items if lbl.startswith("distill teachers")]
    one_node = make_plan(
        load_config(RECIPE, ROOM + STARTED + ["parallel.pp=2", "parallel.ep=4"], check_files=False), 1, GPUS, MEM_GB
    )
    # one node: stage 1 is ranks 4..7, beyond one teacher's single GPU
    assert not [lbl for lbl, _ in one_node.stages[-1].rollout_items if lbl.startswith("distill teachers")]
    wide = make_plan(
        load_config(
            RECIPE, ROOM + STARTED + ["parallel.pp=2", "parallel.ep=4", "distill.teacher_tp=8"], check_files=False
        ),
        1,
        GPUS,
        MEM_GB,
    )
    assert all([lbl for lbl, _ in s.rollout_items if lbl.startswith("distill teachers")] for s in wide.stages)
