"""bench/weight_sync.py runs end to end on a small model (both modes, 2 engines) and every engine
TP rank ends with exactly the HF checkpoint's tensors (the script exits non-zero otherwise). No
timing is asserted."""

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_bench_weight_sync_small_model_delivers_the_checkpoint():
    env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "bench", "weight_sync.py"),
            "--part",
            "all",
            "--hidden",
            "64",
            "--experts",
            "4",
            "--vocab",
            "512",
            "--repeats",
            "1",
            "--engines",
            "2",
            "--case-timeout",
            "400",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("colocated ", "disaggregated "))]
    assert len(rows) == 2 and all(line.endswith("tensors: yes") for line in rows), out.stdout
    assert "qwen3_235b_a22b_gspo.yaml" in out.stdout and "stage 1 source" in out.stdout
