"""The console line shows what the trainer logs: every key of ``metrics.CONSOLE_KEYS`` is in every
row a short run (the CPU demo, 2 steps) writes to metrics.jsonl, and the plain console line of each
step names them all."""

import pytest

from gspo_megatron.metrics import CONSOLE_KEYS
from train_utils import read_metrics, run_train


@pytest.mark.timeout(600)
def test_every_console_key_is_logged(tmp_path):
    out = str(tmp_path / "run")
    proc = run_train(out, ["train.steps=2"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        missing = [k for k in CONSOLE_KEYS if not isinstance(row.get(k), (int, float))]
        assert not missing, f"CONSOLE_KEYS not logged at step {row['step']}: {missing}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2, proc.stdout[-3000:]
    for line in lines:
        assert all(f"{k}=" in line for k in CONSOLE_KEYS), line
