"""Off-policy steps (``rollout.max_staleness`` N >= 1): the trainer's log-probs of the policy that
generated the samples, recomputed with the weights that generated them.

Which behaviour log-probs, and why (docs/training.md, "Off-policy overlap"): pi_old in the sequence
ratio is the *trainer's* forward with the *generating* weights, not the engine's log-probs. With the
engine's log-probs the ratio would carry the engine/trainer numerical gap (kernels, bf16, FP8 on
sync), which GSPO's clip range [1 - 3e-4, 1 + 4e-4] is far narrower than: on-policy samples would be
clipped. With the trainer's forward at the generating weights, s_i == 1 exactly for a sample whose
weights have not moved, s_i measures only the policy change since generation, and the existing
truncated importance weight ``exp(old - engine)`` (``gspo.tis_cap``) keeps covering exactly the
engine/trainer gap at the same weights. This is SPEC section 1's "the trainer recomputes old
log-probs with its own forward", with "its own weights" replaced by "the weights that generated the
samples" (identical when N = 0).

The cost: every rank keeps, in host memory, a copy of its own parameter shard for each policy
version a pending sample may come from (at most N + 1 copies: versions current - N .. current).
Versions here are *policy versions*: the number of trainer steps the weights have taken (a resumed run
starts at the checkpoint's step). The engines name weights by the weight sync's version string
(``WeightSyncer.version``, which also counts re-syncs after an engine restart); ``policy_version``
maps one to the other.

Every rank builds one :class:`WeightHistory` and calls ``synced`` after each weight sync,
``attach_old_logprobs`` and ``trained`` from ``trainer.step.train_on_batch`` (through ``step_passes.GeneratingPolicy``) (collectively: the
forward passes are Megatron schedules).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from gspo_megatron.sample import Sample


def behaviour_versions(record: Sample) -> list[int]:
    """The policy version of each of ``record``'s response tokens (an off-policy run's Samples carry
    them: ``orchestration.async_producer.AsyncProducer.take``)."""
    assert record.behaviour_version is not None, "an off-policy Sample carries behaviour_version"
    return record.behaviour_version


def _params(model) -> list[torch.Tensor]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [p for m in chunks for p in m.parameters()]


def use_engine_behaviour(batches: list[dict]) -> None:
    """In-place updates (``rollout.inflight_updates=in_place``): where ``batch["engine_behaviour"]`` is
    1 the token was sampled over a prefix whose KV cache older weights computed, which no single
    version's forward reproduces; its old log-prob becomes the engine's (``batch["engine_logprobs"]``).
    Batches without the field are left as they are."""
    for b in batches:
        if "engine_behaviour" in b and "engine_logprobs" in b and "old_logprobs" in b:
            b["old_logprobs"] = torch.where(b["engine_behaviour"] > 0, b["engine_logprobs"], b["old_logprobs"])


class WeightHistory:
    """This rank's parameters at the last ``max_staleness + 1`` policy versions (host copies).

    model: the rank's model chunk(s) (the parameters the forward reads; copied in place, so Megatron's
    contiguous parameter buffers stay intact). policy_version: the trainer's version at start-up
    (the resumed step, or 0)."""

    def __init__(self, model, max_staleness: int, policy_version: int):
        self.params = _params(model)
        self.max_staleness = int(max_staleness)
        self.current = int(policy_version)
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.policy_of_sync: dict[str, int] = {}

    # -- bookkeeping -----------------------------------------------------------------------------
    def synced(self, sync_version) -> None:
        """After a weight sync of version ``sync_version`` (every rank): the engines now serve the
        current policy version; keep a host copy of it and drop copies no pending sample can need."""
        self.policy_of_sync[str(sync_version)] = self.current
        if self.current not in self.snapshots:
            self.snapshots[self.current] = [p.detach().to("cpu", copy=True) for p in self.params]
        for v in [v for v in self.snapshots if v < self.current - self.max_staleness]:
            del self.snapshots[v]

    def trained(self) -> None:
        """The step's optimizer updates are done: the weights are the next policy version."""
        self.current += 1

    def policy_version(self, engine_version: str) -> int:
        """The policy version of the weights an engine reported as ``engine_version``."""
        try:
            return self.policy_of_sync[str(engine_version)]
        except KeyError:
            raise RuntimeError(
                f"an engine reported weight version {engine_version!r}, which no weight sync "
                f"of this run pushed (known: {sorted(self.policy_of_sync)})"
            ) from None

    # -- the recomputation -----------------------------------------------------------------------
    @contextmanager
    def weights(self, version: int):
        """The model holds policy ``version``'s weights inside the block (a no-op for the current
        version); the current ones are put back after it."""
        if version == self.current:
            yield
            return
        if version not in self.snapshots:
            raise RuntimeError(
                f"no copy of policy version {version} is kept (current {self.current}, "
                f"rollout.max_staleness={self.max_staleness}, kept {sorted(self.snapshots)})"
            )
        if self.current not in self.snapshots:
            raise RuntimeError(f"the current policy version {self.current} was never synced")
        with torch.no_grad():
            for p, old in zip(self.params, self.snapshots[version]):
                p.copy_(old, non_blocking=True)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, cur in zip(self.params, self.snapshots[self.current]):
                    p.copy_(cur, non_blocking=True)

    def attach_old_logprobs(
        self, model, batches: list[dict], records: list[Sample], temperature: float, fused_logprobs: bool = True
    ) -> dict:
        """batch["old_logprobs"] [b, s]: each response token's log-prob under the trainer's weights of
        the policy version that generated it (``batch["behaviour_version"]``, per token). One forward
        over every micro-batch per distinct version in ``records`` (the step's Samples, their
        ``behaviour_version`` set; identical on every rank, so the
        collectives line up); zeros off the last pipeline stage. Returns {version: token count}."""
        from gspo_megatron.trainer.micro_batches import compute_logprobs

        counts: dict[int, int] = {}
        for r in records:
            for v in behaviour_versions(r):
                counts[int(v)] = counts.get(int(v), 0) + 1
        for b in batches:
            b["old_logprobs"] = torch.zeros_like(b["loss_mask"])
        for v in sorted(counts):
            with self.weights(v):
                out = compute_logprobs(model, batches, temperature=temperature, fused_logprobs=fused_logprobs)
            if out is None:
                continue
            for b, o in zip(batches, out):
                mine = b["behaviour_version"] == float(v)
                b["old_logprobs"] = torch.where(mine, o["logprobs"].float(), b["old_logprobs"])
        return counts
