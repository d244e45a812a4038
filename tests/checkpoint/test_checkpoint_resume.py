"""Distributed checkpoints on 2 gloo ranks (one spawned job; see checkpoint_workers.resume_job):
exact resume (weights after the next step, LR schedule, every RNG stream, extra_state),
keep_last, the `latest` pointer, fallback from a corrupt newest checkpoint, and loading into a
different layout (model reshards; optimizer refuses); HF export of a training root."""

from __future__ import annotations

import os

import pytest

from checkpoint_workers import resume_job
from distributed_harness import run_ranks


@pytest.fixture(scope="module")
def job(tiny_hf_checkpoint):
    hf_dir, _ = tiny_hf_checkpoint("qwen3_moe", seed=2, num_hidden_layers=2)
    return run_ranks(resume_job, 2, hf_dir, os.path.join(os.path.dirname(hf_dir), "run"), dict(ep=2), dict(tp=2))


def test_resume_restores_step_and_extra_state(job):
    for r in job:
        assert r["resumed"] == (1, {"data_position": 17})


def test_resume_continues_bitwise(job):
    assert job[0]["weights_equal"]
    assert all(r["lr_equal"] for r in job)


def test_resume_restores_every_rng_stream(job):
    assert all(r["rng_equal"] for r in job)


def test_keep_last_and_latest_pointer(job):
    assert job[0]["after_prune"] == [2, 3]
    assert job[0]["latest_pointer"] == "step_000003"


def test_corrupt_newest_falls_back_with_warning(job):
    for r in job:
        assert r["fallback"] == (2, {"data_position": 18})
    assert job[0]["fallback_warned"]
    assert job[0]["fallback_weights_equal"]


def test_other_layout_model_reshards_optimizer_refuses(job):
    for r in job:
        assert "can only be resumed in that layout" in r["other_layout_optimizer"]
        assert r["other_layout_model"][0] == 2
    assert job[0]["other_layout_weights_equal"]


def test_megatron_to_hf_accepts_a_training_root(job):
    assert job[0]["export_root_equal"]
