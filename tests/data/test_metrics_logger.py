import json
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gspo_megatron.metrics import MetricsLogger, truncate_metrics_file


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def tb_steps(run_dir, tag):
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def test_rows_flushed_per_step_and_resume_drops_later_rows(tmp_path):
    log = MetricsLogger(tmp_path, console="none")
    for step in range(1, 6):
        log.log(step, {"reward/mean": step / 10, "loss": -step})
        assert len(read_rows(tmp_path / "metrics.jsonl")) == step  # flushed before close
    log.close()
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[2]["reward/mean"] == 0.3
    # resume from a checkpoint at step 3: steps 4, 5 are redone
    with MetricsLogger(tmp_path, resume_step=3, console="none") as log:
        for step in (4, 5, 6):
            log.log(step, {"reward/mean": 1.0, "loss": 0.0})
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["reward/mean"] for r in rows] == [0.1, 0.2, 0.3, 1.0, 1.0, 1.0]
    assert tb_steps(tmp_path, "reward/mean") == [1, 2, 3, 4, 5, 6]


def test_fresh_run_starts_empty_and_torn_lines_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert truncate_metrics_file(str(path), 5) == 1
    assert read_rows(path) == [{"step": 1, "loss": 1.0}]
    with MetricsLogger(tmp_path, console="none", tensorboard=False) as log:
        log.log(1, {"x": 2})
    assert [r["x"] for r in read_rows(path)] == [2]


def test_values_are_json_safe(tmp_path):
    torch = pytest.importorskip("torch")
    with MetricsLogger(tmp_path, console="none", tensorboard=False) as log:
        log.log(1, {"a": torch.tensor(1.5), "b": math.nan, "c": "text", "d": True})
    row = read_rows(tmp_path / "metrics.jsonl")[0]
    assert row["a"] == 1.5 and row["b"] == "nan" and row["c"] == "text" and row["d"] is True
    with pytest.raises(TypeError, match="step must be an int"):
        MetricsLogger(tmp_path / "x", console="none", tensorboard=False).log(1.0, {})


def test_non_zero_rank_writes_nothing(tmp_path, capsys):
    log = MetricsLogger(tmp_path / "r1", rank=1, console="plain")
    log.log(1, {"loss": 1.0})
    log.close()
    assert not (tmp_path / "r1").exists()
    assert capsys.readouterr().out == ""


def test_plain_console_line(tmp_path, capsys):
    with MetricsLogger(tmp_path, console="plain", tensorboard=False, total_steps=10, console_every=2) as log:
        log.log(1, {"reward/mean": 0.25, "loss/total": 0.5})
        log.log(2, {"reward/mean": 0.5, "loss/total": 0.125, "perf/step_time_s": 1.5, "other": 7.0})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(
        "step 2/10  reward/mean=0.5  loss/total=0.125  perf/step_time_s=1.5  elapsed="
    )


def test_wandb_configured_but_missing_is_a_clear_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *a, **k):
        if name == "wandb":
            raise ImportError("no wandb")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ImportError, match="wandb package is not installed"):
        MetricsLogger(tmp_path, console="none", tensorboard=False, wandb_project="p")


def test_rich_progress_bar_runs(tmp_path):
    with MetricsLogger(tmp_path, console="rich", tensorboard=False, total_steps=3) as log:
        for step in (1, 2, 3):
            log.log(step, {"reward/mean": 0.5, "loss": 0.1})
        task = log._progress.tasks[0]
        assert task.completed == 3 and "reward/mean=0.5" in task.description
    assert len(read_rows(tmp_path / "metrics.jsonl")) == 3
