"""The trainer's stop request: SIGTERM or SIGUSR1 (Slurm preemption, ``scancel``, torchrun passing on
its own SIGTERM) sets a flag, read where the run can stop without losing work.

- At the end of a training step (``train.run_step``, every rank agrees by ``any_rank``): checkpoint
  (``checkpoint.save_on_signal``), then exit.
- While the trainer waits on something with no end of its own but a timeout: an SGLang engine
  starting or restarting (``engines.sglang_engine.wait_until_healthy``, up to
  ``rollout.engine_launch_timeout_s``; minutes for a real server loading a large checkpoint). There the
  wait raises :class:`Stopped`; the engine fleet kills the engines it launched, every rank learns of
  it through the fleet's collective, and ``gspo-train`` closes what it started and exits with one
  line and status 0 (nothing of a step is lost: no step had finished since the last checkpoint).

Process-wide, like the signal disposition it mirrors. :func:`install` is called once per rank by
``train.build_trainer``; before that (tools, tests) :func:`requested` is always False.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: int | None = None


class Stopped(Exception):
    """A stop signal arrived while the trainer waited (module docstring). ``str(e)`` is one line."""


def install() -> None:
    """Catch :data:`SIGNALS` in this process: remember the signal instead of dying."""
    for sig in SIGNALS:
        signal.signal(sig, _handle)


def _handle(signum, frame) -> None:
    global _received
    _received = signum


def requested() -> bool:
    """Whether a stop signal has arrived in this process."""
    return _received is not None


def signal_name() -> str:
    """The name of the signal received (``SIGTERM``), or ``""``."""
    return signal.Signals(_received).name if _received is not None else ""


def check(waiting_for: str) -> None:
    """Raise :class:`Stopped` naming ``waiting_for`` when a stop signal has arrived."""
    if _received is not None:
        raise Stopped(f"{signal_name()} received while waiting for {waiting_for}")
