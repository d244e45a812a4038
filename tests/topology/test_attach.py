"""Attached engines (``rollout.engine_urls``, as the launch scripts start them): gspo-train on one rank
waits for an engine that is not up yet (EngineFleet's wait), syncs its weights to it over the
disaggregated weight-update group and trains; the engine is the CPU stand-in for SGLang's HTTP
server, started by the test a few seconds after the trainer (as a launch script may)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
sys.path[:0] = [os.path.join(TESTS, "train"), os.path.join(TESTS, "rollout")]
import cpu_server_util  # noqa: E402
from subprocess_utils import popen_group  # noqa: E402
from train_utils import FAST, read_metrics  # noqa: E402

CONFIG = "configs/topology_30b_tiny.yaml"
LAYOUT = [
    "parallel.tp=1",
    "parallel.ep=1",
    "parallel.sequence_parallel=false",
    "rollout.sync_mode=disaggregated",
    "rollout.engine_tp=1",
    "rollout.num_engines=1",
    "rollout.sync_verify=true",
    "rollout.sync_verify_every=1",
]


def _train_cmd(out: str, *overrides: str) -> list[str]:
    """gspo-train on CONFIG's LAYOUT (one rank), the fast settings, ``overrides`` last."""
    config = os.path.join(REPO, CONFIG)
    return [
        sys.executable,
        "-m",
        "gspo_megatron.train",
        "--config",
        config,
        f"output_dir={out}",
        *FAST,
        *LAYOUT,
        *overrides,
    ]


def test_trainer_waits_for_an_attached_engine_then_syncs_and_trains(tmp_path):
    from gspo_megatron import factory
    from gspo_megatron.config import load_config

    # the engine serves the run's own architecture (its weights are replaced by the first sync)
    made = load_config(os.path.join(REPO, CONFIG), [f"output_dir={tmp_path / 'made'}", *LAYOUT])
    hf_dir = factory.hf_init_dir(made)
    port = cpu_server_util.free_port()
    url = f"http://127.0.0.1:{port}"
    out = str(tmp_path / "run")
    cmd = _train_cmd(out, "train.steps=2", f"rollout.engine_urls=[{url}]", "rollout.engine_launch_timeout_s=300")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    log = tmp_path / "train.log"
    server = None
    with open(log, "w") as f, popen_group(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT) as proc:
        try:
            time.sleep(8.0)  # the trainer is up and waiting for the engine by then
            assert proc.poll() is None, log.read_text()[-3000:]
            real_free_port = cpu_server_util.free_port
            cpu_server_util.free_port = lambda: port  # the engine comes up on the URL the trainer waits on
            try:
                server = cpu_server_util.CpuServer(hf_dir, str(tmp_path))
            finally:
                cpu_server_util.free_port = real_free_port
            assert server.url == url
            code = proc.wait(timeout=600)
        finally:
            if server is not None:
                server.stop()
    assert code == 0, log.read_text()[-4000:]
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["rollout/logprob_abs_diff"] < 1e-4, m["rollout/logprob_abs_diff"]  # the engine has the weights
        assert m["sync/verify_max_abs_diff"] <= 1e-3


def test_an_attached_engine_without_the_flags_the_config_needs_is_refused_in_one_line(tmp_path):
    """rollout.routing_replay=r3 with an engine started without --enable-return-routed-experts: the
    trainer reads the engine's /server_info and stops before the first sync, naming engine, flag and
    field (fleet/engine_args.py), instead of failing at the first rollout."""
    from gspo_megatron import factory
    from gspo_megatron.config import load_config

    made = load_config(os.path.join(REPO, CONFIG), [f"output_dir={tmp_path / 'made'}", *LAYOUT])
    hf_dir = factory.hf_init_dir(made)
    server = cpu_server_util.CpuServer(hf_dir, str(tmp_path))  # sglang_node.sh without GSPO_CONFIG
    try:
        out = str(tmp_path / "run")
        cmd = _train_cmd(out, "rollout.routing_replay=r3", f"rollout.engine_urls=[{server.url}]")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        server.stop()
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "--enable-return-routed-experts" in line]
    assert len(lines) == 1 and server.url in lines[0] and "rollout.routing_replay=r3" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not os.path.exists(os.path.join(out, "metrics.jsonl")) or read_metrics(out) == []
