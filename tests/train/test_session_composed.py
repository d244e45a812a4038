"""``RolloutSession`` is composed once, at construction (issue 26): in a real run, no attribute of
the session is added, removed or (a callable) replaced after its constructor returned, and no
instance attribute shadows a method of its class. Checked on the runs that compose the most parts:
``rollout.offload_train`` with evaluation and ``rollout.sync_verify`` (the colocation's offload and
its sync hook, the verifier), and the off-policy overlap (``rollout.max_staleness``: the overlap as
collector and sync hook), each through gspo-train itself (tests/train/run_driver.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from subprocess_utils import run_group
from train_utils import FAST, REPO

DRIVER = os.path.join(os.path.dirname(__file__), "run_driver.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
DISAGG = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
]


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "rollout.offload_train=true",
            "rollout.sync_verify=true",
            "rollout.sync_verify_every=1",
            "eval.interval=1",
            "eval.datasets=[task:last_digit]",
            "eval.max_prompts=4",
        ],
        [*DISAGG, "rollout.max_staleness=1"],
    ],
    ids=["offload_eval_verify", "offpolicy"],
)
def test_no_session_attribute_is_replaced_during_a_run(tmp_path, overrides):
    out, report_path = str(tmp_path / "run"), str(tmp_path / "report.json")
    args = [
        "--config",
        os.path.join(REPO, "configs/demo_cpu.yaml"),
        f"output_dir={out}",
        *FAST,
        "train.steps=2",
        *overrides,
    ]
    proc = run_group(
        [sys.executable, DRIVER, "session_composed", report_path, "--", *args], timeout=600, cwd=REPO, env=ENV
    )
    assert os.path.exists(report_path), proc.stderr[-4000:]
    with open(report_path) as f:
        report = json.load(f)
    assert report["exit"] == 0, proc.stderr[-4000:]
    assert report["sessions"] == 1
    assert report["added"] == [] and report["removed"] == [] and report["replaced"] == [], report
    assert report["shadows"] == [], report
    assert "_sync_chain" in report["callables"]  # (the check sees the composed sync)
