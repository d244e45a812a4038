"""The published Qwen3.5-MoE layout served by the engines (issue 22): gspo-train from a tiny
``Qwen3_5MoeForConditionalGeneration`` directory (written by transformers 5.23: language model under
``model.language_model.``, a vision tower under ``model.visual.``, one ``mtp.*`` tensor), with the CPU
SGLang stand-in started from that same directory (``--model-path``) and fed the weight sync.

The engine serves the language model (transformers' ``Qwen3_5MoeForCausalLM`` on the text config; the
store keeps the checkpoint's ``model.language_model.*`` names, ``engines/hf_engine.language_model_of``)
and loads every bucket into sglang 0.5.23's own ``Qwen3_5MoeForConditionalGeneration`` too (the CPU
server's ``--sglang-loader-check``, on where sglang imports: a parameter of its language model left
unwritten by a sync fails ``end_weight_update``). Two steps in fp32:

- the engine's log-probs equal the trainer's (``rollout/logprob_abs_diff`` < 1e-4) and the post-sync
  probe (``rollout.sync_verify``, every sync) passes;
- after every sync the engine's weights equal the trainer's HF export bitwise, name by name
  (tests/topology/sync_check.py through torchrun, one rank).

The in-process transformers engine (``rollout.engine=hf``, the demo config's) serves the same directory
with the same log-prob equality.

Before the fix the CPU server did not start from this directory (its sharding read the text fields at
the config's top level) and, with that mended, its store held the text model's ``model.*`` names: it
skipped every ``model.language_model.*`` tensor (start-up and sync alike) and the probe failed; the
transformers engine refused the synced names (KeyError)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from train_utils import REPO, read_metrics, run_sync_check, run_train

VL_ARCH = "Qwen3_5MoeForConditionalGeneration"
SYNC_CHECK = os.path.join(REPO, "tests", "topology", "sync_check.py")
PROBE = ["rollout.sync_verify=true", "rollout.sync_verify_every=1", "train.steps=2", "model.dtype=float32"]
ENGINE = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
    *PROBE,
]


def model(d: str) -> list[str]:
    return [f"model.hf_path={d}", "model.init=pretrained", "model.arch=null"]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    """The tiny vision-language checkpoint (vocabulary 320: the demo tokenizer's 259 ids fit), with
    an ``mtp.*`` tensor (``text_config.mtp_num_hidden_layers``) as the published checkpoint ships."""
    from safetensors.torch import load_file, save_file

    from gspo_megatron.data.tokenizer import build_demo_tokenizer
    from gspo_megatron.models.tiny import save_tiny_hf_model

    d = str(tmp_path_factory.mktemp("qwen3_5_vl") / "tiny-qwen3.5-vl")
    save_tiny_hf_model("qwen3_5_moe", d, seed=5, vocab_size=320, architectures=[VL_ARCH])
    tensors = load_file(f"{d}/model.safetensors")
    assert any(n.startswith("model.visual.") for n in tensors)
    tensors["mtp.fc.weight"] = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    save_file(tensors, f"{d}/model.safetensors", metadata={"format": "pt"})
    with open(f"{d}/config.json") as f:
        cfg = json.load(f)
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    with open(f"{d}/config.json", "w") as f:
        json.dump(cfg, f, indent=2)
    build_demo_tokenizer(d)
    return d


def test_cpu_server_serves_the_vision_language_checkpoint(tmp_path, vl_dir):
    out = str(tmp_path / "run")
    rows, lines = run_sync_check(out, [*ENGINE, *model(vl_dir)], SYNC_CHECK)
    _check_logprobs(rows)
    with open(f"{out}/engine_logs/engine0_node0.log") as f:  # sglang's own class took every bucket too
        assert f"sglang 0.5.23's {VL_ARCH} holds this rank's weights too" in f.read()
    assert len(lines) >= 3, lines  # the first sync + one per step
    with safe_open(f"{vl_dir}/model.safetensors", "pt") as f:
        language_model = [n for n in f.keys() if n.startswith("model.language_model.") or n == "lm_head.weight"]
    for c in lines:
        assert not c["mismatches"] and len(c["engines"]) == 1, c
        assert c["engines"][0]["checked"] == len(language_model), c  # every streamed tensor, by its name


def test_hf_engine_serves_the_vision_language_checkpoint(tmp_path, vl_dir):
    run_train(str(tmp_path / "hf"), ["rollout.engine=hf", *PROBE, *model(vl_dir)])
    _check_logprobs(read_metrics(str(tmp_path / "hf")))


def _check_logprobs(rows: list[dict]) -> None:
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_abs_diff"] < 1e-4, r
        assert r["sync/verify_max_abs_diff"] < 1e-4, r
