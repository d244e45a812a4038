"""Per-step metrics: ``metrics.jsonl`` (one JSON row per step), TensorBoard scalars, optional wandb,
and a console progress line.

Every rank may construct a :class:`MetricsLogger`; only rank 0 writes anything (other ranks get a
silent logger). On resume, rows with ``step > resume_step`` are dropped from ``metrics.jsonl`` (and
TensorBoard events past it are purged), so a resumed run never has duplicate steps; a fresh run
(``resume_step=None``) starts from an empty file.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Mapping

# The key numbers shown on the console line, in order (shown when present). Each is a key the trainer
# logs every step (orchestration.batch, trainer.step, train, weight_sync.sync); tests/train/test_console_keys.py
# checks that a short run produces all of them.
CONSOLE_KEYS = (
    "reward/mean",
    "loss/total",
    "gspo/clip_frac",
    "train/grad_norm",
    "rollout/logprob_abs_diff",
    "perf/step_time_s",
    "sync/total_s",
)


def truncate_metrics_file(path: str, resume_step: int) -> int:
    """Keep only rows with ``step <= resume_step`` (and drop a torn last line); returns rows kept.
    Rewrites atomically (temp file + rename)."""
    if not os.path.exists(path):
        return 0
    kept: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a crash mid-write
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= resume_step:
                kept.append(json.dumps(row) + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(kept)


def _jsonable(value: Any) -> Any:
    """Numbers (including 0-d tensors / numpy scalars) -> float/int; NaN/inf -> their string names."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool) or isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return value if isinstance(value, (str, list, dict)) or value is None else str(value)


class MetricsLogger:
    """Writes one row per step. ``log(step, metrics)`` with a flat dict of scalars.

    run_dir: where ``metrics.jsonl`` and ``tensorboard/`` go. resume_step: the step the run resumed
    from (rows after it are dropped). total_steps: for the progress display. console: "auto" (rich
    progress bar on a terminal, else one plain line every ``console_every`` steps), "rich", "plain"
    or "none". wandb_project: enables wandb (raises if configured but not installed).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        rank: int = 0,
        resume_step: int | None = None,
        total_steps: int | None = None,
        tensorboard: bool = True,
        console: str = "auto",
        console_every: int = 1,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ):
        if console not in ("auto", "rich", "plain", "none"):
            raise ValueError(f"console must be 'auto', 'rich', 'plain' or 'none', got {console!r}")
        self.enabled = rank == 0
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, "metrics.jsonl")
        self.total_steps = total_steps
        self.console_every = max(1, console_every)
        self._file = None
        self._tb = None
        self._wandb = None
        self._progress = None
        self._task = None
        self._start = time.monotonic()
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        # A fresh run (resume_step None) starts an empty file: rows of an earlier attempt are dropped.
        truncate_metrics_file(self.path, -1 if resume_step is None else resume_step)
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = 0 if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(os.path.join(self.run_dir, "tensorboard"), purge_step=purge)
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise ImportError("wandb_project is set but the wandb package is not installed") from e
            self._wandb = wandb.init(
                project=wandb_project, name=wandb_run_name, config=dict(config or {}), resume="allow"
            )
        self._console = self._pick_console(console)
        if self._console == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
            )
            self._progress.start()
            self._task = self._progress.add_task("", total=total_steps, completed=resume_step or 0)

    @staticmethod
    def _pick_console(console: str) -> str:
        if console != "auto":
            return console
        return "rich" if sys.stdout.isatty() else "plain"

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` for ``step`` (rank 0 only; a no-op elsewhere)."""
        if not self.enabled:
            return
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        row = {"step": step, "time/elapsed": round(time.monotonic() - self._start, 3)}
        row.update({k: _jsonable(v) for k, v in metrics.items()})
        assert self._file is not None, "MetricsLogger.log after close()"
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for key, value in numeric.items():
                if key != "step":
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        self._show(step, row)

    def _summary(self, row: Mapping[str, Any]) -> str:
        parts = []
        for key in CONSOLE_KEYS:
            if key in row and isinstance(row[key], (int, float)):
                parts.append(f"{key}={row[key]:.4g}")
        return "  ".join(parts)

    def _show(self, step: int, row: Mapping[str, Any]) -> None:
        if self._progress is not None:
            assert self._task is not None  # added with the progress bar
            self._progress.update(self._task, completed=step, description=self._summary(row))
        elif self._console == "plain" and step % self.console_every == 0:
            total = f"/{self.total_steps}" if self.total_steps else ""
            print(f"step {step}{total}  {self._summary(row)}  elapsed={row['time/elapsed']:.1f}s", flush=True)

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
