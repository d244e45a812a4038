"""Keeps every rank in step with the rollout engines that rank 0 drives, and survives engine deaths.

All ranks call ``sync()`` and ``rollout(step)`` together. Rank 0 talks to the engines and tells the
others, by one broadcast, whether to go on, to restart engines and re-sync (an engine died), or to
stop with an error (so no rank is ever left waiting in a collective). An engine failure is
recognized by a failing call plus a failed health check; a failure with every engine healthy is a
real error. Restarting is collective (``restart(dead)`` on every rank: colocated engines are started
by the ranks that share their GPUs), then the weight-update groups are rebuilt and the weights
pushed again, and the same prompts retried. A user-input error met on rank 0 (e.g. a reward function
failing on every call: ``errors.UserInputError``) is re-raised as such on every rank, so that
``gspo-train`` ends with one line and exit status 2.
"""

from __future__ import annotations

import importlib
import os
import traceback
from contextlib import contextmanager
from typing import Callable

from gspo_megatron.errors import UserInputError
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.runtime.distributed import broadcast_object as broadcast


class RolloutSession:
    """engine / sampler / collect / probe_prompts exist on rank 0 only (None elsewhere).

    syncer: a ``WeightSyncer`` (every rank). collect(step) -> RolloutBatch. dead_engines() -> the
    indices of engines that do not answer (rank 0). restart(dead): collective, brings them back.
    verify: None, or ``(model, tolerance, pad_id)`` to check every engine after each sync
    (``weight_sync.probe``): its weight version after every sync, and the log-prob probe on the
    first sync, the first after an engine restart and every ``verify_every``-th (0: never).

    Memory order (colocated): weights are resumed before the sync, the KV cache after it, and
    nothing generates in between (sglang runs a request on whatever its KV pool maps: on a released
    one, an illegal memory access). With ``kv_cache_after_sync`` (the default) the KV cache comes
    back right after the sync and the probe runs then. Without it (``rollout.offload_train``: the
    training state and the KV cache do not fit on the GPUs together) a probe offloads the training
    state (``offloader``, set by the trainer), resumes the KV cache, generates, releases the KV cache
    again and reloads the state before the trainer scores: one extra offload / reload per probe."""

    def __init__(self, syncer, engine, sampler, collect: Callable, max_restarts: int,
                 dead_engines: Callable[[], list[int]], restart: Callable[[list[int]], None],
                 verify: tuple | None = None, probe_prompts: list[list[int]] | None = None,
                 colocated: bool = False, kv_cache_after_sync: bool = True, verify_every: int = 1):
        self.syncer, self.engine, self.sampler, self.collect = syncer, engine, sampler, collect
        self.max_restarts, self.dead_engines, self.restart = max_restarts, dead_engines, restart
        self.verify, self.probe_prompts, self.colocated = verify, probe_prompts, colocated
        self.kv_cache_after_sync = kv_cache_after_sync  # False with offload_train: after the offload
        self.verify_every = verify_every
        self.offloader = None  # rollout.offload_train: the TrainStateOffloader (train.py sets it)
        self.rank = rdist.rank()
        self.restarts = 0
        self.syncs = 0  # successful syncs so far
        self.probe_owed = False  # an engine was restarted: its first sync is probed

    def release_engines(self) -> None:
        """Colocated, before training: the engines free their weights and KV cache (rank 0 asks).
        An engine that died meanwhile is found by the next sync, which restarts it."""
        if self.colocated and self.rank == 0:
            self._quietly(self.engine.release_memory)

    def resume_kv_cache(self) -> None:
        """Rank 0 (colocated): the engines take their KV cache back (no-op where not released)."""
        self._resume(["kv_cache"])

    def _resume(self, tags: list[str]) -> None:
        """Rank 0: take back what ``release_engines`` freed (weights before the sync, KV cache after;
        the engine object resumes only what it released: a restarted engine holds its memory)."""
        if self.colocated and self.rank == 0:
            self._quietly(self.engine.resume_memory, tags)

    @staticmethod
    def _quietly(fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 - a dead engine: the sync or rollout that follows restarts it
            print(f"[gspo-train] engine memory call failed ({type(e).__name__}: {e}); the next engine call "
                  "decides whether to restart", flush=True)
            return False

    def _failed(self, why: str) -> tuple:
        """Rank 0, after an engine call failed: ("restart", dead engines) or ("fatal", message)."""
        dead = self.dead_engines()
        if not dead:
            return ("fatal", f"rollout failed with a healthy engine: {why}")
        self.restarts += 1
        if self.restarts > self.max_restarts:
            return ("fatal", f"rollout engine failed {self.restarts} times (rollout.max_engine_restarts="
                             f"{self.max_restarts}); last error: {why}")
        print(f"[gspo-train] rollout engine died (engines {dead}: {why.splitlines()[0]}); restarting", flush=True)
        return ("restart", dead)

    def _act(self, status: tuple) -> bool:
        """Every rank: True when ``status`` says go on; restarts engines or raises otherwise."""
        if status[0] == "ok":
            return True
        if status[0] == "fatal":
            raise RuntimeError(status[1])
        if status[0] == "user_error":
            raise UserInputError(status[1])
        try:
            self.restart(status[1])
        except Exception as e:  # noqa: BLE001 - the same message on every rank
            raise RuntimeError(f"rollout engine(s) {status[1]} died and could not be restarted: {e}") from e
        self.probe_owed = True
        if self.rank == 0:
            print(f"[gspo-train] rollout engine(s) {status[1]} restarted ({self.restarts}/{self.max_restarts}), "
                  "re-syncing weights and retrying", flush=True)
        return False

    def sync(self) -> dict:
        """Push the trainer's weights (and check them with ``verify``); after a failure restart the
        dead engines and push again."""
        self._resume(["weights"])
        while True:
            metrics = self.syncer.sync()
            status = ("ok",)
            if self.rank == 0 and self.syncer.errors:
                status = self._failed("; ".join(self.syncer.errors))
            if not self._act(broadcast(status)):
                continue
            if self.kv_cache_after_sync:
                self._resume(["kv_cache"])  # before anything generates (the probe, a health check)
            problem = self._check(metrics)
            if problem is None:
                self.syncs += 1
                return self._after_sync(metrics)
            status = None
            if self.rank == 0:
                status = self._failed(problem) if self.dead_engines() else (
                    "fatal", f"weight sync check failed: {problem}")
            self._act(broadcast(status))

    def probe_due(self) -> bool:
        """Whether this sync runs the log-prob probe (every rank agrees: same counters)."""
        if self.verify is None or self.verify_every <= 0:
            return False
        return self.probe_owed or self.syncs % self.verify_every == 0

    def _check(self, metrics: dict) -> str | None:
        """Every rank, after a sync: None when the engines pass ``verify`` (the weight version every
        sync; the probe when due), else the problem (the same on every rank)."""
        if self.verify is None:
            return None
        from gspo_megatron.weight_sync.probe import check_engines, check_versions

        version = str(self.syncer.version)
        if not self.probe_due():
            return broadcast(check_versions(self.engine, version) if self.rank == 0 else None)
        model, tol, pad_id = self.verify
        result = check_engines(model, self.engine, version, self.probe_prompts, tol, pad_id,
                               generation=self._kv_cache_for_probe)
        metrics["sync/verify_max_abs_diff"] = result.max_abs_diff
        if result.ok:
            self.probe_owed = False
            return None
        return result.message

    @contextmanager
    def _kv_cache_for_probe(self):
        """Every rank, around the probe's generation: the engines hold their KV cache (see the class
        docstring). A no-op where the KV cache is back already (``kv_cache_after_sync``, or not
        colocated); otherwise the training state leaves the devices first and comes back after the
        engines released the KV cache again."""
        if not self.colocated or self.kv_cache_after_sync:
            yield
            return
        offloader = self.offloader if self.offloader is not None and not self.offloader.offloaded else None
        if offloader is not None:
            offloader.offload()
            rdist.barrier()  # every rank's state is off its GPU before the engines take their KV cache back
        resumed = None
        if self.rank == 0:
            try:
                resumed = self.engine.resume_memory(["kv_cache"])
            except Exception as e:  # noqa: BLE001 - the generation that follows fails and says why
                print(f"[gspo-train] engine memory call failed ({type(e).__name__}: {e})", flush=True)
        try:
            yield
        finally:
            if self.rank == 0 and resumed:  # only those that were released (a restarted engine holds its memory)
                self._quietly(lambda: self.engine.release_memory(["kv_cache"], engines=resumed))
            if offloader is not None:
                rdist.barrier()  # the KV cache is released before any rank's state comes back
                offloader.reload()

    def _after_sync(self, metrics: dict) -> dict:
        """The sync succeeded (and the KV cache is back unless ``kv_cache_after_sync`` is off); the
        test hook.

        Test instrumentation, never used by a run: ``GSPO_AFTER_SYNC_HOOK=module:function`` is
        called on every rank after each successful sync as ``function(syncer)`` (the multi-node
        tests read every engine TP rank's weights there through the CPU server's test-only route)."""
        spec = os.environ.get("GSPO_AFTER_SYNC_HOOK")
        if spec:
            module, _, name = spec.partition(":")
            getattr(importlib.import_module(module), name)(self.syncer)
        return metrics

    def rollout(self, step: int, collect: Callable | None = None):
        """(records on every rank, rank 0's rollout metrics or None). A dead engine is restarted,
        re-synced, and the same prompts are retried. ``collect``: instead of the session's own
        (e.g. evaluation's, which returns no records)."""
        collect = collect or self.collect
        while True:
            msg, batch = None, None
            if self.rank == 0:
                position = self.sampler.state_dict()
                try:
                    batch = collect(step)
                    msg = ("ok", batch.records)
                except UserInputError as e:  # not an engine fault: every rank stops with it
                    msg = ("user_error", str(e))
                except Exception as e:  # noqa: BLE001 - classified by _failed, never swallowed
                    self.sampler.load_state_dict(position)
                    msg = self._failed(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            msg = broadcast(msg)
            if msg[0] == "ok":
                return msg[1], (batch.metrics if batch is not None else None)
            self._act(msg)
            self.sync()
