"""A rollout engine living in a child process (forkserver or spawn), behind the ``RolloutEngine`` interface.

Called on global rank 0. The parent sends ``(method, args, kwargs)`` as pickled bytes over a pipe and
waits for the answer while watching the child's process sentinel, so a child that dies (OOM killer,
segfault, ``kill -9``) or stops answering raises :class:`EngineDiedError` instead of hanging. The
caller then ``restart()``s the engine (a fresh child), re-syncs the weights and retries the step a
bounded number of times. Tensors travel as pickled CPU tensors (copied; the CPU demo's weights are
small, and copies cannot leak shared memory when a child is killed).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
import traceback
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from gspo_megatron.engines.base import RolloutEngine, RolloutSample, SamplingParams
from gspo_megatron.runtime.children import run_dying_with_parent


class EngineDiedError(RuntimeError):
    """The engine's process died or stopped answering; ``restart()`` it and re-sync weights."""


class EngineCallError(RuntimeError):
    """The engine raised an exception (the engine process is still alive); carries its traceback."""


def _child_main(conn: Connection, factory: Callable[..., RolloutEngine], kwargs: Mapping[str, Any]) -> None:
    """Child loop: build the engine, then serve calls until told to stop or the pipe closes."""
    try:
        engine = factory(**kwargs)
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it there
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ok", None)))
    while True:
        try:
            method, args, kw = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if method == "__stop__":
            engine.shutdown()
            conn.send_bytes(pickle.dumps(("ok", None)))
            return
        try:
            result = None if method == "__ping__" else getattr(engine, method)(*args, **kw)
            reply = ("ok", result)
        except BaseException:  # noqa: BLE001 - sent to the parent, which raises it there
            reply = ("error", traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply))


class SubprocessRolloutEngine(RolloutEngine):
    """Runs ``factory(**kwargs)`` (a picklable, module-level callable returning a RolloutEngine,
    e.g. ``HFRolloutEngine``) in a child process and forwards every call to it.

    call_timeout_s bounds one call (a child that takes longer is killed: EngineDiedError);
    start_timeout_s bounds the child's start; health_timeout_s bounds ``health_check``.
    """

    def __init__(
        self,
        factory: Callable[..., RolloutEngine],
        kwargs: Mapping[str, Any] | None = None,
        *,
        call_timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        health_timeout_s: float = 10.0,
        start_method: str = "forkserver",
    ):
        self.factory, self.kwargs = factory, dict(kwargs or {})
        self.call_timeout_s, self.start_timeout_s = call_timeout_s, start_timeout_s
        self.health_timeout_s = health_timeout_s
        if start_method not in mp.get_all_start_methods() or start_method == "fork":
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self._ctx = mp.get_context("forkserver") if start_method == "forkserver" else mp.get_context("spawn")
        if start_method == "forkserver":
            # Children fork from a clean server that imported the factory's module once, so a
            # restart after a crash takes a fraction of a second instead of re-importing torch.
            self._ctx.set_forkserver_preload(["torch", getattr(factory, "__module__", "torch")])
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        self.restarts = 0
        self._start()

    # ------------------------------------------------------------------------------- process
    def _start(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        self._proc = self._ctx.Process(
            # dies with the trainer (also on SIGKILL), not only with the fork server
            target=run_dying_with_parent,
            args=(_child_main, child_conn, self.factory, self.kwargs),
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        self._conn = parent_conn
        self._receive("start", self.start_timeout_s)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _kill(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None

    def _receive(self, what: str, timeout_s: float) -> Any:
        """Wait for the child's answer to ``what``; never longer than ``timeout_s``."""
        proc, conn = self._proc, self._conn
        if proc is None or conn is None:
            raise EngineDiedError(f"rollout engine is not running (during {what}); call restart()")
        deadline = time.monotonic() + timeout_s
        while True:
            ready = wait([conn, proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            if conn in ready:
                try:
                    status, payload = pickle.loads(conn.recv_bytes())
                    break
                except (EOFError, OSError):
                    ready = [proc.sentinel]
            if proc.sentinel in ready:
                proc.join(timeout=5)
                code = proc.exitcode
                self._kill()
                raise EngineDiedError(
                    f"rollout engine process (pid {proc.pid}) died during {what} (exit code {code}); "
                    "call restart() and re-sync the weights"
                )
            if time.monotonic() >= deadline:
                self._kill()
                raise EngineDiedError(
                    f"rollout engine process (pid {proc.pid}) did not answer {what} within {timeout_s}s; "
                    "it was killed: call restart() and re-sync the weights"
                )
        if status == "error":
            if what == "start":
                self._kill()
                raise EngineDiedError(f"rollout engine failed to start:\n{payload}")
            raise EngineCallError(f"rollout engine raised during {what}:\n{payload}")
        return payload

    def _call(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> Any:
        if self._conn is None:
            raise EngineDiedError(f"rollout engine is not running (during {method}); call restart()")
        try:
            self._conn.send_bytes(pickle.dumps((method, args, kwargs)))
        except (BrokenPipeError, OSError) as e:
            code = self._proc.exitcode if self._proc is not None else None
            self._kill()
            raise EngineDiedError(
                f"rollout engine process died before {method} (exit code {code}): {e}; call restart()"
            ) from e
        return self._receive(method, self.call_timeout_s if timeout_s is None else timeout_s)

    # ------------------------------------------------------------------------------ interface
    def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        return self._call("generate", [list(map(int, p)) for p in prompts], n, params)

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._call("update_weights", [(name, t.detach().cpu()) for name, t in bucket])

    def begin_weight_update(self) -> None:
        self._call("begin_weight_update")

    def end_weight_update(self) -> None:
        self._call("end_weight_update")

    def release_memory(self, tags=None, engines=None) -> None:
        self._call("release_memory", tags, engines)

    def resume_memory(self, tags=None):
        return self._call("resume_memory", tags)

    def weight_checksums(self, names: Iterable[str]) -> dict[str, float]:
        return self._call("weight_checksums", list(names))

    def call(self, method: str, *args, **kwargs) -> Any:
        """Call any other method of the wrapped engine (e.g. ``checkpoint_names``)."""
        return self._call(method, *args, **kwargs)

    def health_check(self) -> bool:
        """True when the child is alive and answers a ping within ``health_timeout_s``."""
        if self._proc is None or not self._proc.is_alive():
            return False
        try:
            self._call("__ping__", timeout_s=self.health_timeout_s)
            return True
        except (EngineDiedError, EngineCallError):
            return False

    def restart(self) -> None:
        """Kill the child (if any) and start a fresh one; the caller must re-sync the weights."""
        self._kill()
        self.restarts += 1
        self._start()

    def shutdown(self) -> None:
        """Stop the child politely (bounded wait), then by force."""
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._call("__stop__", timeout_s=10.0)
            except (EngineDiedError, EngineCallError):
                pass
        self._kill()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to report to
            pass
