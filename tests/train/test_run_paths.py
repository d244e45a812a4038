"""End-to-end runs of the paths a healthy demo run never takes, each through gspo-train itself
(``gspo_megatron.train.main`` in a subprocess, tiny config, few steps), with the failure injected
where the path is a failure path:

- starting from ``model.checkpoint`` (a previous run's checkpoints), and from ``model.init=pretrained``
  with a sharded HF checkpoint (model.safetensors.index.json, 3 shards);
- the KL reference model (``gspo.kl_coef > 0``): KL 0 at step 1, > 0 after updates, reference frozen;
- ``optimizer.max_bad_steps``: a run whose loss turns NaN stops after that many skipped steps, with a
  checkpoint of the last good weights;
- ``RolloutSession``'s fatal paths: an engine process that keeps dying beyond
  ``rollout.max_engine_restarts``, and a healthy engine whose call raises;
- a transport failure mid-sync (the engine's weight update raising half-way through a sync), and
  ``rollout.sync_verify`` stopping a run whose engine does not hold the trainer's weights.

Fault injection and observation go through tests/train/run_driver.py (wrappers around product
functions, nothing replaced).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from subprocess_utils import popen_group, run_group
from train_utils import FAST, REPO, read_metrics, run_train, train_cmd

sys.path.insert(0, os.path.join(REPO, "bench"))
import fault_injection

DRIVER = os.path.join(os.path.dirname(__file__), "run_driver.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
TINY_LR = "optimizer.lr=1e-12"  # Adam moves each weight by ~lr: far below fp32 resolution of O(0.01) weights


def drive(
    mode: str, out_dir: str, overrides: list[str], timeout: int = 600
) -> tuple[subprocess.CompletedProcess, dict]:
    report = os.path.join(out_dir + ".report.json")
    args = ["--config", os.path.join(REPO, "configs/demo_cpu.yaml"), f"output_dir={out_dir}", *FAST, *overrides]
    proc = run_group([sys.executable, DRIVER, mode, report, "--", *args], timeout=timeout, cwd=REPO, env=ENV)
    assert os.path.exists(report), proc.stderr[-4000:]
    with open(report) as f:
        return proc, json.load(f)


def hf_weights(hf_dir) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (single file or shards)."""
    out = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(hf_dir, name)))
    return out


def assert_close_weights(a: dict, b: dict, atol: float = 1e-8) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=0, atol=atol), k


def assert_differ(a: dict, b: dict) -> None:
    assert any(not torch.allclose(a[k].float(), b[k].float(), rtol=0, atol=1e-4) for k in a)


def latest_checkpoint_step(out_dir) -> int:
    return fault_injection.latest_step(str(out_dir))


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A finished 2-step run: checkpoints/ (final step) and hf_final/ hold the same weights."""
    out = str(tmp_path_factory.mktemp("first") / "run")
    run_train(out, ["train.steps=2"])
    assert latest_checkpoint_step(out) == 2
    return out


def test_model_checkpoint_starts_from_a_previous_runs_weights(first_run, tmp_path):
    out = str(tmp_path / "second")
    run_train(out, [f"model.checkpoint={first_run}/checkpoints", "train.steps=1", TINY_LR])
    assert [m["step"] for m in read_metrics(out)] == [1]  # a new run (step 1), not a resume at step 3
    start = hf_weights(os.path.join(first_run, "hf_final"))
    assert_close_weights(hf_weights(os.path.join(out, "hf_final")), start)
    assert_differ(hf_weights(os.path.join(out, "hf_init")), start)  # the random init was not used


def test_kl_reference_model_is_frozen_and_kl_grows_from_zero(first_run, tmp_path):
    out = str(tmp_path / "kl")
    proc, report = drive(
        "observe",
        out,
        [
            f"model.checkpoint={first_run}/checkpoints",
            "gspo.kl_coef=0.1",
            "gspo.mini_batches=1",
            "optimizer.lr=0.01",
            "train.steps=3",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    kl = [m["loss/kl_ref"] for m in read_metrics(out)]
    assert len(kl) == 3
    assert abs(kl[0]) < 1e-6, kl  # step 1, one mini-batch: the policy IS the reference
    assert kl[1] > 1e-6 and kl[2] > 1e-6, kl  # after updates the policy has left the reference
    assert report["models_built"] == 2
    assert report["ref_started_as_policy"] and report["policy_moved"]
    assert report["ref_unchanged"]


def _write_sharded(src_dir: str, dst_dir: str, shards: int = 3) -> dict[str, torch.Tensor]:
    """Copy an HF directory, its weights split into ``shards`` files with an index (HF's layout)."""
    os.makedirs(dst_dir)
    weights = load_file(os.path.join(src_dir, "model.safetensors"))
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n].contiguous() for n in names[i::shards]}
        save_file(part, os.path.join(dst_dir, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    with open(os.path.join(dst_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    for name in os.listdir(src_dir):
        if not name.endswith(".safetensors"):
            with open(os.path.join(src_dir, name), "rb") as a, open(os.path.join(dst_dir, name), "wb") as b:
                b.write(a.read())
    return weights


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pretrained_init_from_a_sharded_hf_checkpoint(tmp_path, dtype):
    """In bfloat16 the optimizer's fp32 main parameters are copies, made when the optimizer is built
    (before the HF weights are loaded): without ``reload_model_params`` after the load, the first
    step wrote Megatron's random init (plus the update) over the loaded weights."""
    from gspo_megatron import factory
    from gspo_megatron.config import load_config

    # an HF model directory (weights + demo tokenizer) with other weights than the run's own random init
    made = load_config(os.path.join(REPO, "configs/demo_cpu.yaml"), [f"output_dir={tmp_path / 'made'}", "seed=7"])
    weights = _write_sharded(factory.hf_init_dir(made), str(tmp_path / "sharded"))
    assert len([n for n in os.listdir(tmp_path / "sharded") if n.endswith(".safetensors")]) == 3
    out = str(tmp_path / "run")
    run_train(
        out,
        [
            "model.init=pretrained",
            f"model.hf_path={tmp_path / 'sharded'}",
            "model.arch=null",
            "train.steps=1",
            TINY_LR,
            f"model.dtype={dtype}",
        ],
    )
    assert not os.path.exists(os.path.join(out, "hf_init"))  # the HF directory itself is the start
    # fp32: the same weights; bf16: exactly the same weights rounded to bf16 (the fp32 main copy of
    # those, moved by ~1e-12, rounds back to them)
    start = weights if dtype == "float32" else {k: v.bfloat16() for k, v in weights.items()}
    assert_close_weights(hf_weights(os.path.join(out, "hf_final")), start)
    random_start = load_config(os.path.join(REPO, "configs/demo_cpu.yaml"), [f"output_dir={tmp_path / 'rnd'}"])
    assert_differ(hf_weights(factory.hf_init_dir(random_start)), weights)
    # the engine got the same weights (bf16: engine and trainer kernels round differently, ~4e-4 seen)
    assert read_metrics(out)[0]["rollout/logprob_abs_diff"] < (1e-4 if dtype == "float32" else 5e-3)


def test_run_stops_after_max_bad_steps_with_the_last_good_checkpoint(tmp_path):
    out = str(tmp_path / "bad")
    proc, report = drive("nan_loss_from=2", out, ["optimizer.max_bad_steps=2", "train.steps=6"])
    assert proc.returncode != 0
    assert report["train_on_batch_calls"] == 3
    assert (
        "2 consecutive steps had a non-finite loss or gradient norm (optimizer.max_bad_steps=2); stopping"
    ) in proc.stderr
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["train/bad_streak"] for m in metrics] == [0, 1, 2]
    assert [m["train/skipped_updates"] for m in metrics] == [0, 2, 2]  # both mini-batches of a bad step
    assert latest_checkpoint_step(out) == 3  # saved before stopping: the weights of step 1 (no update since)
    assert not os.path.exists(os.path.join(out, "hf_final"))


def test_a_healthy_engine_that_raises_stops_the_run(tmp_path):
    out = str(tmp_path / "raises")
    # generate calls: the first sync's log-prob probe (rollout.sync_verify, on by default), step 1's
    # rollout, then step 2's, which raises
    proc, report = drive("engine_raises_at=3", out, ["train.steps=4", "rollout.dynamic_sampling=false"])
    assert proc.returncode != 0
    assert "rollout failed with a healthy engine: RuntimeError: injected: generate rejected the request" in proc.stderr
    assert report["generate_calls"] == 3  # no retry: the error is a real one, not an engine death
    assert [m["step"] for m in read_metrics(out)] == [1]


def test_a_transport_failure_mid_sync_stops_the_run(tmp_path):
    """The engine's weight update raises half-way through the 3rd sync (step 2's; the 1st is at
    start-up), the engine staying healthy: the syncer reports it, the session stops every rank with
    the error (an engine holding half-updated weights must not serve step 3's rollout). Step 2 ends
    with its sync, so only step 1's metrics row is written."""
    out = str(tmp_path / "sync")
    proc, report = drive("sync_raises_at=3", out, ["train.steps=4", "rollout.dynamic_sampling=false"])
    assert report["raised"] == 1
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert (
        "rollout failed with a healthy engine: rank 0: RuntimeError: injected: weight update failed mid-sync"
    ) in proc.stderr, proc.stderr[-3000:]
    assert report["syncs"] == 3  # no retry on a healthy engine
    assert [m["step"] for m in read_metrics(out)] == [1]


def test_sync_verify_stops_a_run_whose_engine_lost_a_tensor(tmp_path):
    """rollout.sync_verify: from the 3rd sync (step 2's) on the engine holds one MLP weight zeroed; the post-sync
    check (greedy probe, engine log-probs vs the trainer's) stops the run naming the difference.
    Without the check the run would go on training on samples from the wrong policy."""
    out = str(tmp_path / "verify")
    proc, report = drive(
        "engine_corrupts_from=3", out, ["train.steps=3", "rollout.sync_verify=true", "rollout.sync_verify_every=1"]
    )
    assert report["corrupted"], report
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "weight sync check failed: engine log-probs differ from the trainer's" in proc.stderr, proc.stderr[-3000:]
    assert report["syncs"] == 3
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1]
    assert metrics[0]["sync/verify_max_abs_diff"] < 1e-3  # step 1's (correct) sync passed the same check


def test_an_engine_that_keeps_dying_stops_the_run(tmp_path):
    """rollout.engine_process=true, max_engine_restarts=1: the first death is survived (restart,
    re-sync, retry), the second stops every rank with one clear error."""
    out = str(tmp_path / "dying")
    log_path = tmp_path / "log.txt"
    cmd = train_cmd(out, [*FAST, "train.steps=30", "rollout.engine_process=true", "rollout.max_engine_restarts=1"])
    killed: list[int] = []

    def log() -> str:
        return log_path.read_text()

    def wait_for(cond, what: str, proc, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert proc.poll() is None, f"run ended while waiting for {what}:\n{log()[-4000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{log()[-4000:]}"
            time.sleep(0.2)

    def kill_engine(proc) -> None:
        engines = fault_injection.find_targets(proc.pid)["engine"]
        assert len(engines) == 1, (engines, log()[-2000:])
        os.kill(engines[0], 9)
        killed.append(engines[0])

    with open(log_path, "w") as f, popen_group(cmd, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT) as proc:
        wait_for(lambda: fault_injection.metrics_steps(out), "step 1", proc)
        kill_engine(proc)
        wait_for(lambda: "restarted (1/1)" in log(), "the engine restart", proc)
        steps = len(fault_injection.metrics_steps(out))
        wait_for(lambda: len(fault_injection.metrics_steps(out)) > steps, "a step on the new engine", proc)
        kill_engine(proc)
        assert proc.wait(timeout=300) != 0
    text = log()
    assert killed[0] != killed[1]  # the second kill hit the restarted engine
    assert "rollout engine failed 2 times (rollout.max_engine_restarts=1)" in text, text[-4000:]
    assert max(fault_injection.metrics_steps(out)) < 30
