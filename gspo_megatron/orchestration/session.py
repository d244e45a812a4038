"""Keeps every rank in step with the rollout engines that rank 0 drives, and survives engine deaths.

All ranks call ``sync()``, ``rollout(step)`` and ``evaluate(step, collect)`` together. Rank 0 talks
to the engines and tells the others, by one broadcast, whether to go on, to restart engines and
re-sync (an engine died), or to stop with an error (so no rank is ever left waiting in a
collective). An engine failure is recognized by a failing call plus a failed health check; a failure
with every engine healthy is a real error. Restarting is collective (``restart(dead)`` on every rank:
colocated engines are started by the ranks that share their GPUs), then the weight-update groups are
rebuilt and the weights pushed again, and the same prompts retried. A user-input error met on rank 0
(e.g. a reward function failing on every call: ``errors.UserInputError``) is re-raised as such on
every rank, so that ``gspo-train`` ends with one line and exit status 2.

The session is composed once, at construction, from parts the trainer builds from the config
(``train.build_rollout_side``); none of its methods is replaced afterwards:

- ``collector``: what generates a step's batch, ``collect(step)`` and its prompt ``sampler``
  (:class:`SyncCollector` for the synchronous loop, ``orchestration.async_producer.Overlap`` for the
  off-policy overlap);
- ``colocation`` (``orchestration.colocation.Colocation``): engine memory and training-state offload
  before / after a rollout, around a push and around the probe;
- ``sync_hooks``: functions ``hook(sync) -> metrics`` wrapped around every sync, outermost first
  (the colocation's offload reload is always the outermost; the overlap's bracket);
- ``verifier`` (``orchestration.probe.SyncVerifier``): the check after each sync, or None;
- ``after_sync(syncer)``: test instrumentation called on every rank after each successful sync.
"""

from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from gspo_megatron.errors import UserInputError
from gspo_megatron.orchestration.colocation import Colocation
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.runtime.distributed import broadcast_object as broadcast

if TYPE_CHECKING:
    from gspo_megatron.orchestration.batch import RolloutBatch
    from gspo_megatron.orchestration.probe import SyncVerifier

SyncHook = Callable[[Callable[[], dict]], dict]  # hook(sync) -> the sync's metrics


class Collector(Protocol):
    """What generates the batch of a step (rank 0; ``sampler`` None elsewhere)."""

    @property
    def sampler(self) -> Any:  # state_dict() / load_state_dict(): the prompt position, restored after a failure
        ...

    def collect(self, step: int) -> RolloutBatch: ...


@dataclass
class SyncCollector:
    """The synchronous loop: ``collect(step)`` generates the batch of ``step`` when called."""

    collect: Callable[[int], Any]
    sampler: Any


class RolloutSession:
    """engine and the collector's sampler exist on rank 0 only (None elsewhere).

    syncer: a ``WeightSyncer`` (every rank). collector: see the module docstring (None: a session
    that only syncs). dead_engines() -> the indices of engines that do not answer (rank 0).
    restart(dead): collective, brings them back. colocation: default not colocated, no offload."""

    def __init__(
        self,
        syncer,
        engine,
        collector: Collector | None,
        max_restarts: int,
        dead_engines: Callable[[], list[int]],
        restart: Callable[[list[int]], None],
        *,
        colocation: Colocation | None = None,
        verifier: SyncVerifier | None = None,
        sync_hooks: Sequence[SyncHook] = (),
        after_sync: Callable[[Any], None] | None = None,
    ):
        self.syncer, self.engine, self.collector = syncer, engine, collector
        self.max_restarts, self.dead_engines, self.restart = max_restarts, dead_engines, restart
        self.colocation = colocation if colocation is not None else Colocation(engine)
        self.verifier, self.after_sync = verifier, after_sync
        self.rank = rdist.rank()
        self.restarts = 0
        self.syncs = 0  # successful syncs so far
        chain: Callable[[], dict] = self._push_and_check
        for hook in reversed([self.colocation.around_sync, *sync_hooks]):
            chain = functools.partial(hook, chain)
        self._sync_chain = chain  # composed once: hooks outermost first, the push innermost

    @property
    def sampler(self):
        """Rank 0: the collector's prompt sampler (its position is what the checkpoint keeps)."""
        return self.collector.sampler if self.collector is not None else None

    def _failed(self, why: str) -> tuple:
        """Rank 0, after an engine call failed: ("restart", dead engines) or ("fatal", message)."""
        dead = self.dead_engines()
        if not dead:
            return ("fatal", f"rollout failed with a healthy engine: {why}")
        self.restarts += 1
        if self.restarts > self.max_restarts:
            return (
                "fatal",
                f"rollout engine failed {self.restarts} times (rollout.max_engine_restarts="
                f"{self.max_restarts}); last error: {why}",
            )
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
        except Exception as e:  # the same message on every rank
            raise RuntimeError(f"rollout engine(s) {status[1]} died and could not be restarted: {e}") from e
        if self.verifier is not None:
            self.verifier.engine_restarted()
        restarted = getattr(self.syncer, "engines_restarted", None)
        if restarted is not None:  # delta sync: a restarted engine holds no copy, the next push is full
            restarted()
        if self.rank == 0:
            print(
                f"[gspo-train] rollout engine(s) {status[1]} restarted ({self.restarts}/{self.max_restarts}), "
                "re-syncing weights and retrying",
                flush=True,
            )
        return False

    def sync(self) -> dict:
        """Push the trainer's weights through the sync hooks (and check them with the verifier);
        after a failure restart the dead engines and push again. Returns the sync's metrics."""
        return self._sync_chain()

    def _push_and_check(self) -> dict:
        """The innermost sync: push, check, restart and push again until the check passes."""
        self.colocation.before_push()
        while True:
            metrics = self.syncer.sync()
            status: tuple | None = ("ok",)
            if self.rank == 0 and self.syncer.errors:
                status = self._failed("; ".join(self.syncer.errors))
            if not self._act(broadcast(status)):
                continue
            self.colocation.after_push()  # before anything generates (the probe, a health check)
            problem = self._check(metrics)
            if problem is None:
                self.syncs += 1
                if self.after_sync is not None:
                    self.after_sync(self.syncer)
                return metrics
            status = None
            if self.rank == 0:
                status = (
                    self._failed(problem) if self.dead_engines() else ("fatal", f"weight sync check failed: {problem}")
                )
            self._act(broadcast(status))

    def _check(self, metrics: dict) -> str | None:
        """Every rank, after a sync: None when the engines pass the verifier, else the problem."""
        if self.verifier is None:
            return None
        return self.verifier.check(
            self.engine, str(self.syncer.version), self.syncs, metrics, generation=self.colocation.for_probe
        )

    def rollout(self, step: int) -> tuple[list, dict | None]:
        """The batch of a training step: (records on every rank, rank 0's rollout metrics or None).
        The colocation prepares the devices before it and hands them to the trainer after it."""
        self.colocation.before_rollout()
        out = self._generate(step, self.collector.collect if self.collector is not None else None)
        self.colocation.after_rollout()
        return out

    def evaluate(self, step: int, collect: Callable[[int], Any]) -> dict | None:
        """Evaluation's generation (``collect`` returns no records): rank 0's metrics (None
        elsewhere); the devices are left as after a step's sync."""
        self.colocation.before_rollout()
        _, metrics = self._generate(step, collect)
        self.colocation.after_evaluation(self.sync)
        return metrics

    def _generate(self, step: int, collect: Callable | None) -> tuple[list, dict | None]:
        """A dead engine is restarted, re-synced, and the same prompts are retried."""
        while True:
            msg, batch = None, None
            if self.rank == 0:
                if collect is None:  # rank 0 holds the collector (and evaluation passes its own)
                    raise RuntimeError("RolloutSession: rank 0 has nothing to collect a batch with")
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
