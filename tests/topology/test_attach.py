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


def test_trainer_waits_for_an_attached_engine_then_syncs_and_trains(tmp_path):
    from gspo_megatron import factory
    from gspo_megatron.config import load_config

    # the engine serves the run's own architecture (its weights are replaced by the first sync)
    made = load_config(os.path.join(REPO, CONFIG), [f"output_dir={tmp_path / 'made'}", *LAYOUT])
    hf_dir = factory.hf_init_dir(made)
    port = cpu_server_util.free_port()
    url = f"http://127.0.0.1:{port}"
    out = str(tmp_path / "run")
    cmd = [
        sys.executable,
        "-m",
        "gspo_megatron.train",
        "--config",
        os.path.join(REPO, CONFIG),
        f"output_dir={out}",
        *FAST,
        "train.steps=2",
        *LAYOUT,
        f"rollout.engine_urls=[{url}]",
        "rollout.engine_launch_timeout_s=300",
    ]
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
