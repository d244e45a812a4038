"""The MTP draft through the other weight-sync modes (issue 34): ``gspo-train`` under ``torchrun`` on 2
ranks (EP 2), GLM-4.5's tiny checkpoint with its MTP layer, ``rollout.speculative=true`` with the MTP
loss on, CPU-server engines decoding speculatively, launched through tests/train/ordered_sync_check.py:
after every sync every engine TP rank's weights, the draft's MTP layer (``model.layers.<N>.*``, its own
shard store in the CPU server) included, must equal the trainer's HF export bitwise.

- colocated, owner-direct delta syncs (``rollout.sync_owner_direct=true``, ``rollout.sync_delta=true``):
  each rank encodes the changes of what it serves, the draft's tensors among them;
- disaggregated delta syncs (``rollout.sync_delta=true`` through files named by HTTP,
  ``weight_sync/delta_http.py``).

The full broadcast and the NCCL-style disaggregated full sync are tests/train/test_speculative_run.py's.
FP8 syncs cannot run on the CPU server (``features/fp8_sync.py`` refuses it); which MTP tensors they
quantize is tests/models/test_mtp_model.py's."""

from __future__ import annotations

import json
import os

import pytest

from test_sync_delta_run import _run
from train_utils import write_demo_tokenized_checkpoint

SPECULATIVE = [
    "rollout.speculative=true",
    "rollout.speculative_steps=2",
    "gspo.mtp_loss_coef=1.0",
    "model.init=pretrained",
    "model.arch=null",
    "parallel.ep=2",
    "model.dtype=float32",  # the tiny checkpoint's dtype, which the engines serve
]


@pytest.mark.parametrize(
    "mode",
    [
        ["rollout.sync_owner_direct=true", "rollout.sync_delta=true"],
        ["rollout.sync_mode=disaggregated", "rollout.num_engines=1", "rollout.sync_delta=true"],
    ],
    ids=["colocated-owner-direct-delta", "disaggregated-delta"],
)
def test_the_draft_reaches_the_engines_bitwise_in_every_sync_mode(tmp_path, mode):
    hf_dir = write_demo_tokenized_checkpoint(str(tmp_path / "tiny-glm4_moe"), "glm4_moe", seed=0, with_mtp=True)
    n = json.load(open(os.path.join(hf_dir, "config.json")))["num_hidden_layers"]
    rows, checks = _run(tmp_path, "run", [*SPECULATIVE, f"model.hf_path={hf_dir}", *mode])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["loss/mtp"] > 0 and "spec/engine_accept_rate" in r for r in rows)
    assert len(checks) >= 5  # the first sync + one per step
    for c in checks:
        assert not c["mismatches"] and c["engines"] and all(e["checked"] for e in c["engines"]), c
    # the draft's shards were among the checked ones: the export carries the trained MTP layer
    from gspo_megatron.cpu_server import read_weight_shards  # noqa: F401 - the route the check reads

    assert any(f"model.layers.{n}." in name for name in _exported_names(tmp_path / "run"))


def _exported_names(out) -> list[str]:
    from gspo_megatron.cpu_server.weights import iter_checkpoint

    return [name for name, _ in iter_checkpoint(str(out / "hf_final"))]
