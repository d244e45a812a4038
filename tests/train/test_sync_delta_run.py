"""The assembled delta-sync path (``rollout.sync_delta=true``): gspo-train under torchrun, 2 ranks,
two colocated CPU-server engines (engine_tp 1) started with the delta loader as sglang's
``--custom-weight-loader``, bf16 weights. The same run with full syncs (same seed) must give the
same learning metrics, and after every sync every engine TP rank's weights must equal the trainer's
HF export bitwise (tests/topology/sync_check.py; tests/train/ordered_sync_check.py launches both runs
with one generation request at a time, so that the batch order does not vary between runs). The delta run's first
sync is full and its later syncs send a fraction of the bytes."""

from __future__ import annotations

import json
import os
import sys

from gspo_megatron.runtime.ports import free_port
from subprocess_utils import run_group
from train_utils import FAST, REPO, read_metrics

SYNC_CHECK = os.path.join(REPO, "tests", "train", "ordered_sync_check.py")  # sync_check.py, one request at a time
COLOCATED = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=colocated",
    "rollout.engine_tp=1",
    "model.dtype=bfloat16",
    "optimizer.lr=1e-4",
    "train.steps=4",
    # per-request seeds: two engines serve concurrent requests in an order that varies from
    # run to run, so without them two identical full-sync runs already differ
    "rollout.engine_deterministic=true",
]
# what differs between two identical runs (clocks) or between the sync modes by design
VARYING = ("sync/", "time/", "perf/", "timing/")


def _run(tmp_path, name: str, extra: list[str]) -> tuple[list[dict], list[dict]]:
    out, checks = str(tmp_path / name), tmp_path / f"{name}_checks.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        SYNC_CHECK,
        "--config",
        os.path.join(REPO, "configs/demo_cpu.yaml"),
        f"output_dir={out}",
        *FAST,
        *COLOCATED,
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", GSPO_SYNC_CHECK_FILE=str(checks))
    proc = run_group(cmd, timeout=900, cwd=REPO, env=env)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return read_metrics(out), [json.loads(line) for line in checks.read_text().splitlines()]


def _learning(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith(VARYING) and "_s" not in k.rsplit("/", 1)[-1]} for r in rows
    ]


def full_and_delta_runs(tmp_path, extra: list[str], engines: int) -> tuple[list[dict], list[dict]]:
    """The full-sync and the delta-sync run of one layout: every sync's engines bitwise equal to the
    export (``engines`` of them checked), the same learning metrics; returns (full rows, delta rows)."""
    full_rows, full_checks = _run(tmp_path, "full", extra)
    delta_rows, delta_checks = _run(tmp_path, "delta", [*extra, "rollout.sync_delta=true"])
    for checks in (full_checks, delta_checks):
        assert len(checks) >= 5  # the first sync + one per step
        for c in checks:
            assert not c["mismatches"] and len(c["engines"]) == engines and all(e["checked"] for e in c["engines"]), c
    diff = [
        (f["step"], k, f.get(k), d.get(k))
        for f, d in zip(_learning(full_rows), _learning(delta_rows))
        for k in sorted(set(f) | set(d))
        if f.get(k) != d.get(k)
    ]
    assert len(delta_rows) == len(full_rows) and not diff, diff[:20]
    return full_rows, delta_rows


def test_delta_sync_learns_as_full_sync_and_engines_match_bitwise(tmp_path):
    full_rows, delta_rows = full_and_delta_runs(tmp_path, [], engines=2)
    fractions = [r["sync/delta_wire_bytes"] / r["sync/delta_full_bytes"] for r in delta_rows]
    assert all(f < 1.0 for f in fractions), fractions
    assert "sync/delta_wire_bytes" not in full_rows[0]


def test_first_sync_after_the_initial_one_is_a_delta(tmp_path):
    """Only the sync at start-up is full: at an RL learning rate in bf16 the sync after step 1 sends
    a small fraction, as later ones do. It sent nearly every element whole when train.resume loaded
    the HF weights into the bf16 model but left the optimizer's fp32 main params at build_model's
    init: the first optimizer step wrote that init (+ the update) back over the loaded weights."""
    rows, checks = _run(tmp_path, "delta", ["rollout.sync_delta=true", "optimizer.lr=1e-6", "train.steps=2"])
    assert all(not c["mismatches"] for c in checks), checks
    for r in rows:
        assert r["sync/delta_tensors_full"] == 0 and r["sync/delta_fraction"] < 0.2, (r["step"], r)
        assert r["sync/delta_wire_bytes"] < 0.5 * r["sync/delta_full_bytes"], (r["step"], r)
