"""Disaggregated engines start before the trainer builds its model (train.build_trainer), so that
SGLang's start-up overlaps the model build and the checkpoint load; colocated engines start after
(they share the trainer's GPUs). A failure or a stop signal in between leaves no engine running."""

from __future__ import annotations

import os

import psutil
import pytest

from distributed_harness import run_ranks
from train_utils import CPU_ENGINE_DISAGGREGATED, FAST, REPO


def _engines_of(pid: int) -> list[psutil.Process]:
    """The engine servers below ``pid`` (launch_server names each with GSPO_ENGINE)."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "GSPO_ENGINE" in p.environ():
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def _still_running(procs: list[psutil.Process]) -> int:
    """How many of ``procs`` are alive 30 s from now at the latest (a killed server's process group
    may take a moment to exit)."""
    return len(psutil.wait_procs(procs, timeout=30)[1])


def _config(out: str, sync: str):
    from gspo_megatron.config import load_config

    mode = [o for o in CPU_ENGINE_DISAGGREGATED if not o.startswith("rollout.sync_mode")]
    return load_config(
        os.path.join(REPO, "configs/demo_cpu.yaml"),
        [*FAST, *mode, f"rollout.sync_mode={sync}", "train.steps=1", f"output_dir={out}"],
    )


def _one_step_run(rank, world, out, sync):
    """build_trainer -> (what is running now) -> resume -> build_rollout_side -> one step -> finish."""
    from gspo_megatron import train

    cfg = _config(out, sync)
    run = train.build_trainer(cfg)
    after_build = {
        "starting": run.engines_starting is not None,
        "engines": len(_engines_of(os.getpid())),
        "model": run.model is not None,
    }
    train.resume(cfg, run)
    train.build_rollout_side(cfg, run)
    engines = _engines_of(os.getpid())
    stopped = train.run_step(cfg, run, 1)
    train.finish(cfg, run, stopped)
    return after_build, run.metrics, _still_running(engines)


@pytest.mark.parametrize("sync, early", [("disaggregated", True), ("colocated", False)])
def test_disaggregated_engines_start_while_the_model_is_built(tmp_path, sync, early):
    after_build, metrics, left = run_ranks(_one_step_run, 1, str(tmp_path / "run"), sync, timeout=600)[0]
    # disaggregated: launched by build_trainer and running before build_rollout_side waits for them
    assert after_build == {"starting": early, "engines": 1 if early else 0, "model": True}
    assert metrics["step"] == 1 and metrics["rollout/engine_restarts"] == 0.0
    assert metrics["sync/verify_max_abs_diff"] <= 1e-5, metrics  # the engine generates with the trainer's weights
    assert left == 0  # finish() stopped the engine


def _model_build_fails(rank, world, out):
    """The model build raises after the engines were launched: build_trainer stops them."""
    from gspo_megatron import factory, train

    engines = []

    def broken(cfg, hf):
        engines.extend(_engines_of(os.getpid()))
        assert engines, "the engine was launched before the model is built"
        raise MemoryError("out of memory building the model")

    factory.build_model = broken  # (this rank's process only)
    with pytest.raises(MemoryError):
        train.build_trainer(_config(out, "disaggregated"))
    return _still_running(engines)


def _resume_fails(rank, world, out):
    """The checkpoint load raises after build_trainer: train() stops the engines launched early."""
    from gspo_megatron import train

    engines = []

    def broken(cfg, run):
        engines.extend(_engines_of(os.getpid()))
        assert run.engines_starting is not None and engines
        raise OSError("checkpoint unreadable")

    train.resume = broken  # (this rank's process only)
    with pytest.raises(OSError, match="checkpoint unreadable"):
        train.train(_config(out, "disaggregated"), checked=True)
    return _still_running(engines)


@pytest.mark.parametrize("fails", [_model_build_fails, _resume_fails], ids=["model_build", "resume"])
def test_a_failure_before_the_engines_are_ready_leaves_none_running(tmp_path, fails):
    assert run_ranks(fails, 1, str(tmp_path / "run"), timeout=600) == [0]
