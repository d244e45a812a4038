"""Who holds the GPUs when: the engines' memory (colocated engines) and the training state
(``rollout.offload_train``) around a rollout, a sync and the probe a sync runs.

:class:`Colocation` is built by the trainer from the config and handed to ``RolloutSession`` at
construction; the session calls it at fixed points and nothing else moves memory:

- ``before_rollout()`` / ``after_rollout()``: around a step's rollout (and an evaluation's).
  With ``offloader``: the training state leaves the devices, every rank waits, rank 0 resumes the
  engines' KV cache; after it the engines release their weights and KV cache (colocated) and the
  training state comes back once every rank got there.
- ``before_push()`` / ``after_push()``: around a weight push: the engines' weights are resumed
  before it, the KV cache after it (``kv_cache_after_sync``: not with ``offloader``, where the
  training state and the KV cache do not fit on the GPUs together).
- ``for_probe()``: around the post-sync probe's generation: the engines hold their KV cache (with
  ``offloader``: offload the state, resume the KV cache, generate, release it, reload the state).
- ``around_sync(sync)``: the sync hook of the offloader: a sync (an engine restarted during a
  rollout is re-synced there) finds the training state on the devices.

Memory order (colocated): nothing generates between a release and the matching resume (sglang runs a
request on whatever its KV pool maps: on a released one, an illegal memory access). Rank 0 drives
the engines; every rank calls every method at the same point (the barriers are collective).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Protocol

from gspo_megatron.runtime import distributed as rdist


class Offloader(Protocol):
    """What :class:`Colocation` needs of ``trainer.offload.TrainStateOffloader``."""

    offloaded: bool

    def offload(self) -> int | None: ...

    def reload(self) -> int | None: ...

    def loaded_call(self, fn: Callable) -> Callable: ...


def quietly(fn, *args) -> bool:
    """Call an engine memory function; a failure is printed, not raised (a dead engine: the sync or
    rollout that follows finds it and restarts it)."""
    try:
        fn(*args)
        return True
    except Exception as e:  # noqa: BLE001 - a dead engine: the sync or rollout that follows restarts it
        print(
            f"[gspo-train] engine memory call failed ({type(e).__name__}: {e}); the next engine call "
            "decides whether to restart",
            flush=True,
        )
        return False


class Colocation:
    """Engine memory and training-state offload around rollouts and syncs (module docstring).

    engine: rank 0's rollout engine (None elsewhere); colocated: the engines share the trainer's
    GPUs (their memory is released after each rollout); offloader: ``rollout.offload_train``'s
    ``TrainStateOffloader`` or None."""

    def __init__(self, engine=None, colocated: bool = False, offloader: Offloader | None = None, teachers: Any = None):
        self.engine, self.colocated, self.offloader = engine, colocated, offloader
        self.teachers = teachers  # rank 0's distill.teachers.TeacherPool: started GPU teachers release too
        self.kv_cache_after_sync = offloader is None  # with offload_train: after the next offload
        self.rank = rdist.rank()

    # -- engine memory (rank 0 asks) ------------------------------------------------------------
    def release_engines(self) -> None:
        """Colocated: the engines free their weights and KV cache. An engine that died meanwhile is
        found by the next sync, which restarts it."""
        if self.colocated and self.rank == 0:
            quietly(self.engine.release_memory)

    def resume(self, tags: list[str]) -> None:
        """Colocated: take back what ``release_engines`` freed (weights before the sync, KV cache
        after; the engine object resumes only what it released: a restarted engine holds its memory)."""
        if self.colocated and self.rank == 0:
            quietly(self.engine.resume_memory, tags)

    # -- around a rollout -----------------------------------------------------------------------
    def before_rollout(self) -> None:
        """With the offloader (after the previous step's sync and checkpoint): every rank's state
        leaves its GPU before the engines take their KV cache back."""
        if self.offloader is not None:
            self.offloader.offload()
            rdist.barrier()
            self.resume(["kv_cache"])
        if self.teachers is not None:
            quietly(self.teachers.resume)

    def after_rollout(self) -> None:
        """Colocated: the engines' weights and KV cache leave the GPUs; with the offloader the state
        comes back before training, once rank 0 has released the engines' memory. Started GPU
        teachers (``distill/teacher_servers.py``) release theirs too."""
        self.release_engines()
        if self.teachers is not None:
            quietly(self.teachers.release)
        if self.offloader is not None:
            rdist.barrier()
            self.offloader.reload()

    def after_evaluation(self, sync: Callable[[], dict]) -> None:
        """After an evaluation's generation: back to the state the loop expects after a step's sync
        (with the offloader: engines released, state reloaded, weights pushed again)."""
        if self.offloader is not None:
            self.after_rollout()
            sync()

    # -- around a sync --------------------------------------------------------------------------
    def before_push(self) -> None:
        self.resume(["weights"])

    def after_push(self) -> None:
        """Before anything generates (the probe, a health check)."""
        if self.kv_cache_after_sync:
            self.resume(["kv_cache"])

    @contextmanager
    def for_probe(self) -> Iterator[None]:
        """Every rank, around the probe's generation: the engines hold their KV cache. A no-op where
        it is back already (``kv_cache_after_sync``, or not colocated); otherwise the training state
        leaves the devices first and comes back after the engines released the KV cache again."""
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
                quietly(lambda: self.engine.release_memory(["kv_cache"], engines=resumed))
            if offloader is not None:
                rdist.barrier()  # the KV cache is released before any rank's state comes back
                offloader.reload()

    def around_sync(self, sync: Callable[[], dict]) -> dict:
        """Sync hook: ``sync()`` with the training state on the devices: if it is offloaded, it is
        reloaded for the sync and offloaded again after (every rank calls it at the same point)."""
        if self.offloader is None or not self.offloader.offloaded:
            return sync()
        return self.offloader.loaded_call(sync)()
