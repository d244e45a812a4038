"""GSPO with LoRA end to end (``model.lora``, ``rollout.lora_sync=merged``): a few steps of the demo in
process (transformers engine) and colocated with the CPU server (sglang's protocol, the export stream's
merged weights through ``update_weights_from_tensor``): the engine's log-probs equal the trainer's
(``rollout/logprob_abs_diff`` ~ 0), only the adapters move, the sync metrics carry the adapter bytes;
a resume with another ``model.lora`` than the checkpoint's is refused in one line before any model is
built. The learning curve itself (minutes): ``python bench/lora_learning.py`` (docs/training.md)."""

from __future__ import annotations

import os

import pytest

from test_run_paths import drive
from train_utils import read_metrics, run_train

LORA = ["model.lora.rank=8", "model.lora.alpha=16", "optimizer.lr=0.02"]
PLACEMENTS = {
    "inprocess": [],
    "colocated": [
        "rollout.engine=sglang",
        "rollout.engine_server=cpu",
        "rollout.sync_mode=colocated",
        "rollout.engine_tp=1",
    ],
}


@pytest.fixture(scope="module", params=sorted(PLACEMENTS))
def lora_run(request, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lora") / request.param)
    proc, report = drive("observe", out, [*LORA, *PLACEMENTS[request.param], "checkpoint.interval=3"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return request.param, out, report, read_metrics(out)


def test_lora_engine_matches_trainer_and_only_adapters_move(lora_run):
    placement, _, report, rows = lora_run
    assert len(rows) == 3
    gaps = [r["rollout/logprob_abs_diff"] for r in rows]
    assert max(gaps) < 1e-5, (placement, gaps)  # fp32: the engine serves the merged W + s B A exactly
    changed = report["policy_changed"]
    assert changed and all(n.endswith((".lora_A", ".lora_B")) for n in changed), changed
    assert any(n.endswith(".lora_B") for n in changed)  # B left zero: the merged model moved
    for r in rows:  # the merged sync sends the model; an adapter sync would send this much
        assert 0 < r["sync/lora_adapter_bytes"] < r["sync/bytes_total"], r


def test_resume_with_another_lora_is_refused(lora_run):
    placement, out, _, _ = lora_run
    if placement != "inprocess":  # the same command (no placement override), refused before any model is built
        pytest.skip("the refusal reads only the checkpoint's model.lora: checked once, on the in-process run's")
    proc = run_train(out, [*LORA, "model.lora.rank=16", "train.steps=4"], check=False, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("gspo-train: error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("gspo-train: error: model.lora differs from the one output_dir's checkpoint"), lines[0]
    assert "(rank 16 here vs 8 in the checkpoint)" in lines[0] and os.path.join(out, "checkpoints") in lines[0], lines[
        0
    ]
    assert "Traceback" not in proc.stderr
