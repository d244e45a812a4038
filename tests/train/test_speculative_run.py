"""The assembled path of speculative rollouts with the MTP draft trained and synced (issue 34), as a user
runs it: GLM-4.5's tiny checkpoint with its MTP layer (``model.layers.<N>.*``) on EP 2, and Qwen3.5-MoE's
vision-language one (``mtp.*``: a full-attention MoE layer after a hybrid Gated DeltaNet stack, Qwen3-Next's
layout; the language model under ``model.language_model.``, the vision tower carried) on PP 2 (the MTP layer
on the last stage), each written by transformers' ``save_pretrained`` plus the published MTP layout ->
``gspo-train`` under ``torchrun`` on 2 ranks,
``rollout.speculative=true`` (``model.mtp`` null: on) with ``gspo.mtp_loss_coef=1`` and a disaggregated
CPU-server engine that decodes speculatively (sglang's acceptance rule) and loads every sync into sglang's
own target and draft classes (the written check on both) -> the final HF export.

Checked:
- every step reports the engine's acceptance (``spec/engine_accept_length`` in [1, steps + 1],
  ``spec/engine_accept_rate`` in [0, 1]), the trainer's exact first-token acceptance on the same rollouts
  (``spec/draft_accept_rate``), the MTP loss (``loss/mtp``), and the engine still agrees with the trainer
  (``rollout/logprob_abs_diff``, the post-sync probe);
- ``hf_final`` holds the MTP layer, trained (its tensors moved; GLM's layer's ``embed_tokens`` /
  ``shared_head.head`` carried unchanged), loads in sglang's draft class (``Glm4MoeForCausalLMNextN`` /
  ``Qwen3_5ForCausalLMMTP``: every parameter of its own written; Qwen3-Next's ``Qwen3NextForCausalLMMTP``:
  tests/train/test_mtp_step.py) and in transformers (which ignores it), and scores as the run's final checkpoint does (read back through ``tools/score.py`` with its MTP layer);
- that checkpoint as ``model.checkpoint`` with ``model.mtp=false`` is refused in one line before any work
  (it would lose the trained draft: ``preflight.check_mtp_matches``);
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from distributed_harness import run_ranks
from mtp_step_workers import sglang_draft_loads
from train_utils import (
    CPU_ENGINE_DISAGGREGATED,
    read_metrics,
    run_train,
    score_checkpoint,
    write_demo_tokenized_checkpoint,
)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
from hf_reference import hf_logprobs, max_abs_diff

STEPS = 3
SPEC_STEPS = 2
ROWS = [list(range(40, 40 + n)) for n in (9, 17)]


def _tensors(d: str) -> dict:
    from gspo_megatron.cpu_server.weights import iter_checkpoint

    return dict(iter_checkpoint(d))


# sglang 0.5.23's draft class of each family (configs/model_config.py renames the architecture)
DRAFT_CLASS = {"glm4_moe": "Glm4MoeForCausalLMNextN", "qwen3_5_moe": "Qwen3_5ForCausalLMMTP"}


VL = {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}  # Qwen3.5-MoE's published layout


@pytest.mark.parametrize(
    "family, layout, extra",
    [("glm4_moe", "parallel.ep=2", {}), ("qwen3_5_moe", "parallel.pp=2", VL)],
    ids=["glm4_moe-ep2", "qwen3_5_vl-pp2"],
)
def test_speculative_mtp_run_trains_syncs_and_exports_the_draft(tmp_path, family, layout, extra):
    import transformers

    from gspo_megatron.models.carried import mtp_names
    from gspo_megatron.models.hf_config import lift_text_config
    from gspo_megatron.models.mtp import mtp_naming

    hf_dir = write_demo_tokenized_checkpoint(str(tmp_path / f"tiny-{family}"), family, seed=0, with_mtp=True, **extra)
    hf = lift_text_config(json.load(open(os.path.join(hf_dir, "config.json"))))
    naming = mtp_naming(hf)
    out = str(tmp_path / "run")
    run_train(
        out,
        [
            *CPU_ENGINE_DISAGGREGATED,
            "rollout.speculative=true",
            f"rollout.speculative_steps={SPEC_STEPS}",
            "rollout.max_new_tokens=8",
            "gspo.mtp_loss_coef=1.0",
            "rollout.engine_max_running_requests=8",  # 16 sequences a step: the engine runs them in two waves
            f"train.steps={STEPS}",
            f"model.hf_path={hf_dir}",
            "model.init=pretrained",
            "model.arch=null",
            layout,
        ],
        nproc=2,
        timeout=900,
    )
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert 1.0 <= r["spec/engine_accept_length"] <= SPEC_STEPS + 1, r
        assert 0.0 <= r["spec/engine_accept_rate"] <= 1.0, r
        assert 0.0 <= r["spec/draft_accept_rate"] <= 1.0, r
        assert r["loss/mtp"] > 0, r
        assert r["rollout/logprob_abs_diff"] < 1e-4, r
        assert r["sync/verify_max_abs_diff"] < 1e-4, r

    with open(os.path.join(out, "engine_logs", "engine0_node0.log")) as f:
        assert "'max_running_requests': 8," in f.read()  # the flag reached the engine (its start-up line)

    export = os.path.join(out, "hf_final")
    source, exported = _tensors(hf_dir), _tensors(export)
    assert sorted(source) == sorted(exported)
    mtp = mtp_names(hf, source)
    carried = set(naming.shared_names(hf))
    assert carried < set(mtp) or family != "glm4_moe" and not carried  # Qwen's mtp.* layer has no copies
    for k in carried:
        assert torch.equal(source[k], exported[k]), k  # carried unchanged (sglang's draft shares the target's)
    moved = [k for k in set(mtp) - carried if not torch.equal(source[k], exported[k])]
    assert naming.own(hf)["eh_proj.weight"] in moved and len(moved) > 10  # the draft trained

    if family == "glm4_moe":  # a checkpoint with the trained MTP layer read without it: refused up front
        again = str(tmp_path / "again")
        ckpt = os.path.join(out, "checkpoints")
        model = [f"model.hf_path={hf_dir}", "model.init=pretrained", "model.arch=null"]
        proc = run_train(again, [*model, f"model.checkpoint={ckpt}", "model.mtp=false"], check=False, timeout=300)
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("gspo-train: error:")]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
        assert "model.mtp=false but model.checkpoint's checkpoint" in lines[0], lines[0]

    # sglang's draft class loads the exported MTP layer: every parameter of its own written, as exported
    (draft,) = run_ranks(sglang_draft_loads, 1, export)
    assert draft["class"] == DRAFT_CLASS[family] and draft["unwritten"] == []
    assert torch.equal(*draft["eh_proj"])

    arch = hf["architectures"][0]
    lm = getattr(transformers, arch).from_pretrained(export, dtype=torch.float32)  # ignores the MTP layer
    assert type(lm).__name__ == arch
    trainer = score_checkpoint(os.path.join(out, "checkpoints"), ROWS, str(tmp_path / "score"))
    assert max_abs_diff(hf_logprobs(lm, ROWS), trainer) < 1e-4
