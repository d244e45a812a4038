"""LoRA checkpoints on 2 gloo ranks (tp2; see lora_checkpoint_workers.lora_resume_job): only the
adapters train and have optimizer state, the base stays bitwise; a resumed run continues bitwise
(adapters and their Adam moments restored); the checkpoint reads into ep2 and exports to HF merged
(``W + (alpha/r) B A``) with the same tensors as the trainer's export stream. The same on Transformer
Engine's layer spec through the TE stand-in, from ep2 (grouped experts, one adapter per expert, keyed
by global expert) into tp2."""

from __future__ import annotations

import os

import pytest

from distributed_harness import run_ranks
from lora_checkpoint_workers import lora_resume_job


@pytest.fixture(scope="module", params=["local", "transformer_engine"])
def job(tiny_hf_checkpoint, request):
    hf_dir, _ = tiny_hf_checkpoint("qwen3_moe", seed=2, num_hidden_layers=2)
    run = os.path.join(os.path.dirname(hf_dir), f"run-{request.param}")
    if request.param == "local":
        return run_ranks(lora_resume_job, 2, hf_dir, run, dict(tp=2), dict(ep=2))
    return run_ranks(lora_resume_job, 2, hf_dir, run, dict(ep=2), dict(tp=2), "transformer_engine")


def test_only_adapters_train(job):
    for r in job:
        assert r["base_unchanged"]
        assert 0 < r["optimizer_params"] <= r["adapter_params"]


def test_resume_continues_bitwise(job):
    assert all(r["resumed"] == (1, {"data_position": 3}) for r in job)
    assert [r["adapters_differing"] for r in job] == [[]] * len(job)
    assert job[0]["weights_equal"] and job[0]["merged_moved"]


def test_other_layout_and_merged_export(job):
    assert job[0]["other_layout_equal"]
    assert job[0]["export_equal"]
