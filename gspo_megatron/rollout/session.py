"""Keeps every rank in step with the rollout engine that rank 0 drives, and survives engine deaths.

All ranks call ``sync()`` and ``rollout(step)`` together. Rank 0 talks to the engine and tells the
others, by one broadcast, whether to go on, to re-sync the weights (the engine was restarted), or to
stop with an error (so no rank is ever left waiting in a collective). A user-input error met on rank 0
(e.g. a reward function failing on every call: ``errors.UserInputError``) is re-raised as such on
every rank, so that ``gspo-train`` ends with one line and exit status 2. An engine failure is recognized
by a failing call plus a failed ``health_check``; a healthy engine that raises is a real error.
"""

from __future__ import annotations

import traceback
from typing import Callable

import torch.distributed as dist

from gspo_megatron.errors import UserInputError
from gspo_megatron.runtime.distributed import broadcast_object as broadcast


class RolloutSession:
    """engine / transport / sampler / collect exist on rank 0 only (None elsewhere).
    collect(step) -> RolloutBatch; syncer: a WeightSyncer (every rank)."""

    def __init__(self, syncer, engine, transport, sampler, collect: Callable, max_restarts: int):
        self.syncer, self.engine, self.transport = syncer, engine, transport
        self.sampler, self.collect, self.max_restarts = sampler, collect, max_restarts
        self.rank = dist.get_rank()
        self.restarts = 0

    def _failed(self, error: BaseException) -> tuple:
        """Rank 0, after an engine call failed: ("retry", why) once restarted, else ("fatal", why)."""
        why = f"{type(error).__name__}: {error}"
        if self.engine.health_check():
            return ("fatal", f"rollout failed with a healthy engine: {why}\n{traceback.format_exc()}")
        self.restarts += 1
        if self.restarts > self.max_restarts:
            return ("fatal", f"rollout engine failed {self.restarts} times (rollout.max_engine_restarts="
                             f"{self.max_restarts}); last error: {why}")
        try:
            self.engine.restart()
        except Exception as e:  # noqa: BLE001 - becomes a clear fatal error on every rank
            return ("fatal", f"rollout engine died ({why}) and could not be restarted: {e}")
        print(f"[gspo-train] rollout engine died ({why}); restarted ({self.restarts}/{self.max_restarts}),"
              " re-syncing weights and retrying", flush=True)
        return ("retry", why)

    def sync(self) -> dict:
        """Push the trainer's weights; after a transport failure restart the engine and push again."""
        while True:
            metrics = self.syncer.sync(self.transport, self.engine)
            failed = self.rank == 0 and self.syncer.error is not None
            status = broadcast(self._failed(self.syncer.error) if failed else ("ok",))
            if status[0] == "ok":
                return metrics
            if status[0] == "fatal":
                raise RuntimeError(status[1])

    def rollout(self, step: int):
        """(records on every rank, rank 0's rollout metrics or None). A dead engine is restarted,
        re-synced, and the same prompts are retried."""
        while True:
            msg, batch = None, None
            if self.rank == 0:
                position = self.sampler.state_dict()
                try:
                    batch = self.collect(step)
                    msg = ("ok", batch.records)
                except UserInputError as e:  # not an engine fault: every rank stops with it
                    msg = ("user_error", str(e))
                except Exception as e:  # noqa: BLE001 - classified by _failed, never swallowed
                    self.sampler.load_state_dict(position)
                    msg = self._failed(e)
            msg = broadcast(msg)
            if msg[0] == "ok":
                return msg[1], (batch.metrics if batch is not None else None)
            if msg[0] == "fatal":
                raise RuntimeError(msg[1])
            if msg[0] == "user_error":
                raise UserInputError(msg[1])
            self.sync()
