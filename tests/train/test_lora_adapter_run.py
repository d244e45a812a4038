"""GSPO with LoRA and adapter-only sync (``rollout.lora_sync=adapter``, weight_sync/lora_adapter.py), end
to end, colocated with the CPU server: the first sync sends the unmerged base and the adapter, every
later one only the adapter (``/load_lora_adapter_from_tensors`` as ``policy-v<N>``, the previous version
unloaded), every rollout request and the sync probe name it in ``lora_path``. The same run with
``rollout.lora_sync=merged`` (same seed) learns the same: the engine serves ``W + s B A`` in fp32 either
way, so the metrics agree to fp32 rounding, and ``rollout/logprob_abs_diff`` ~ 0; the sync bytes per step
are the adapter's (``sync/adapter_bytes``) against the merged model's."""

from __future__ import annotations

import glob
import os

import pytest

from train_utils import read_metrics, run_train

LORA = [
    "model.lora.rank=8",
    "model.lora.alpha=16",
    "optimizer.lr=0.02",
    "model.lora.target_modules=[self_attention.linear_qkv,self_attention.linear_proj]",
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=colocated",
    "rollout.engine_tp=1",
    "rollout.sync_verify=true",
    "rollout.sync_verify_every=1",
    # the same samples in the same order every run: per-request sampling seeds, and one prompt group per
    # step (the SGLang engine delivers concurrent groups as they finish, so with several the batch order, and
    # with it the mini-batches, differ from run to run even between two merged runs)
    "rollout.engine_deterministic=true",
    "rollout.prompts_per_step=1",
    "rollout.group_size=16",
    "rollout.dynamic_sampling=false",
]


def _lora_run(tmp_path_factory, tag: str, args: list[str], mode: str, nproc: int = 1) -> tuple[str, list[dict]]:
    """The run of ``args`` with ``rollout.lora_sync=mode``: (output dir, metrics)."""
    d = str(tmp_path_factory.mktemp(tag) / mode)
    proc = run_train(d, [*args, f"rollout.lora_sync={mode}"], nproc=nproc, check=False, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return d, read_metrics(d)


def _adapter_and_merged(tmp_path_factory, tag: str, args: list[str], nproc: int = 1) -> dict:
    """The same run with ``rollout.lora_sync=adapter`` and ``=merged``: mode -> (output dir, metrics)."""
    return {mode: _lora_run(tmp_path_factory, tag, args, mode, nproc) for mode in ("adapter", "merged")}


def _learns_like_merged(adapter: list[dict], merged: list[dict]) -> None:
    """Per step: the engine serves the trainer's model, and the run's metrics are the merged run's."""
    for a, m in zip(adapter, merged):
        assert a["rollout/logprob_abs_diff"] < 1e-5, a["rollout/logprob_abs_diff"]
        for k in ("reward/mean", "loss/policy", "gspo/ratio_mean", "rollout/logprob_abs_diff"):
            assert abs(a[k] - m[k]) <= 1e-5 * max(1.0, abs(m[k])), (a["step"], k, a[k], m[k])


@pytest.fixture(scope="module")
def merged_run(tmp_path_factory):
    """The colocated merged run: the reference of the colocated and of the disaggregated adapter run."""
    return _lora_run(tmp_path_factory, "lora_sync", LORA, "merged")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, merged_run):
    return {"adapter": _lora_run(tmp_path_factory, "lora_sync", LORA, "adapter"), "merged": merged_run}


def test_adapter_sync_learns_like_merged(runs):
    (adir, adapter), (_, merged) = runs["adapter"], runs["merged"]
    assert len(adapter) == len(merged) == 3
    _learns_like_merged(adapter, merged)
    # bytes: the adapter (attention linears, rank 8) is what each adapter sync sends; the merged sync sends the model
    for a, m in zip(adapter, merged):
        assert a["sync/adapter_bytes"] == a["sync/bytes_total"] == a["sync/lora_adapter_bytes"] > 0, (
            a
        )  # A once (fused qkv)
        assert a["sync/base_bytes"] == 0.0
        assert a["sync/adapter_bytes"] < m["sync/bytes_total"] / 3, (a["sync/adapter_bytes"], m["sync/bytes_total"])
    log = "".join(open(p).read() for p in glob.glob(os.path.join(adir, "engine_logs", "*.log")))
    assert "Traceback" not in log


DISAGG = [x for x in LORA if not x.startswith("rollout.sync_mode=")] + [
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
]


@pytest.fixture(scope="module")
def disagg_adapter_run(tmp_path_factory):
    return _lora_run(tmp_path_factory, "lora_sync_disagg", DISAGG, "adapter")


def test_adapter_sync_disaggregated_learns_like_merged(disagg_adapter_run, merged_run):
    """sync_mode=disaggregated: the base goes once over the weight-update group, then each sync writes
    the adapter as a PEFT directory <output_dir>/lora_adapters/policy-v<N> and the engine loads it with
    ``POST /load_lora_adapter`` (sglang's path route); the previous version's directory is removed once
    it is unloaded. Learns like the merged run: the colocated ``merged_run`` (same seed, samples and
    engine kind; the sync mode only changes how the weights reach the engine, and a disaggregated
    merged run measured the same metrics to the last bit), so one merged run serves both tests."""
    (adir, adapter), (_, merged) = disagg_adapter_run, merged_run
    assert len(adapter) == len(merged) == 3
    _learns_like_merged(adapter, merged)
    for a, m in zip(adapter, merged):
        assert a["sync/adapter_bytes"] > 0
    left = sorted(os.listdir(os.path.join(adir, "lora_adapters")))
    assert len(left) == 1 and left[0].startswith("policy-v"), left  # only the version being served
    assert sorted(os.listdir(os.path.join(adir, "lora_adapters", left[0]))) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    log = "".join(open(p).read() for p in glob.glob(os.path.join(adir, "engine_logs", "*.log")))
    assert "Traceback" not in log


# tp2 x ep2 (etp1) in 2 ranks: the attention adapters' TP shards (B of the column-parallel linear_qkv, A of
# the row-parallel linear_proj) and each EP rank's experts' adapters are gathered to rank 0 at every sync
EXPERTS = [x for x in LORA if not x.startswith("model.lora.target_modules=")] + [
    "model.lora.target_modules=[self_attention.linear_qkv,self_attention.linear_proj,experts.linear_fc1,"
    "experts.linear_fc2]",
    "parallel.tp=2",
    "parallel.ep=2",
    "parallel.etp=1",
]


@pytest.fixture(scope="module")
def expert_runs(tmp_path_factory):
    return _adapter_and_merged(tmp_path_factory, "lora_sync_experts", EXPERTS, nproc=2)


def test_adapter_sync_tp2_ep2_with_routed_experts_learns_like_merged(expert_runs):
    """parallel.tp=2 x ep=2 (etp 1, 2 ranks) with routed-expert adapters (experts.linear_fc1 / linear_fc2):
    the attention adapters' TP shards and each EP rank's experts' adapters are gathered to rank 0 each sync
    (``gathered_peft_tensors``) under sglang's per-expert names (``...mlp.experts.<e>.gate_proj`` /
    ``up_proj`` / ``down_proj``); the CPU server applies them per expert, the engine serves the trainer's
    model (logprob diff ~ 0) and the run learns like the tp2 x ep2 merged run."""
    (adir, adapter), (_, merged) = expert_runs["adapter"], expert_runs["merged"]
    assert len(adapter) == len(merged) == 3
    _learns_like_merged(adapter, merged)
    for a, m in zip(adapter, merged):
        assert a["sync/adapter_bytes"] == m["sync/lora_adapter_bytes"] > 0
    log = "".join(open(p).read() for p in glob.glob(os.path.join(adir, "engine_logs", "*.log")))
    assert "Traceback" not in log
