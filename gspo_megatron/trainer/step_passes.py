"""The passes of one training step (``trainer.step.train_on_batch``), composed from the enabled
components when the step is built, so that the step itself is a fixed sequence of passes:

1. old log-probs (:meth:`StepPasses.logprobs`): the policy's forward over every micro-batch inside
   the routing replay's :meth:`~RoutingReplayPasses.recording`; the old log-probs come from the
   behaviour component: :class:`CurrentPolicy` (on-policy: the trainer's current weights) or
   :class:`GeneratingPolicy` (off-policy, ``rollout.max_staleness`` >= 1: the weights that generated
   each token, ``trainer.behaviour_policy.WeightHistory``);
2. reference log-probs (same method, after pass 1): :class:`ReferenceModel` (``gspo.kl_coef`` > 0)
   replays the routes of pass 1 (r3: the engine's; r2: pass 1's record) on the frozen reference, so
   that its KL term compares the two policies on one routing; :class:`NoReference` otherwise;
3. the training forwards, inside :meth:`~RoutingReplayPasses.replaying` (``trainer.step``: one
   optimizer step per mini-batch); then :meth:`StepPasses.trained` (the behaviour history learns
   that the weights moved on).

Every batch is a micro-batch dict of ``trainer.micro_batches``; the passes write ``old_logprobs`` /
``ref_logprobs`` (float32 [b, s], zeros off the last pipeline stage) into it. Routing replay off
(``rollout.routing_replay=off``) is a :class:`RoutingReplayPasses` without state, whose blocks do
nothing.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from gspo_megatron.sample import Sample
from gspo_megatron.trainer.behaviour_policy import WeightHistory, behaviour_versions, use_engine_behaviour
from gspo_megatron.trainer.micro_batches import compute_logprobs
from gspo_megatron.trainer.route_replay import RouteReplay, replay_phase, route_replay_for


def attach_logprobs(
    model, batches: list[dict], key: str, temperature: float, fused: bool = True, drafts: bool = False
) -> None:
    """batch[key] = the model's log-probs of the labels, float32 [b, s] (last stage; zeros of the
    ``loss_mask``'s shape elsewhere, unused). ``drafts`` (a model with MTP layers): the same forward
    also counts the draft's first-token acceptance into batch["draft_accept"] / ["draft_positions"]
    (last stage; ``losses/mtp_loss.draft_acceptance``)."""
    out = compute_logprobs(model, batches, temperature=temperature, fused_logprobs=fused, with_drafts=drafts)
    for i, b in enumerate(batches):
        b[key] = out[i]["logprobs"].float() if out is not None else torch.zeros_like(b["loss_mask"])
        if out is not None and "draft_positions" in out[i]:
            b["draft_accept"], b["draft_positions"] = out[i]["draft_accept"], out[i]["draft_positions"]


@dataclass(frozen=True)
class RoutingReplayPasses:
    """``rollout.routing_replay`` of the policy model: ``state`` None when off (every block then does
    nothing and no count is taken)."""

    state: RouteReplay | None

    def check(self, records: list[Sample]) -> None:
        """r3 replays the engine's routes: every Sample must carry ``routed_experts`` (and, for a DSA
        model, ``indexer_topk``); ValueError naming the field and the first sample without it."""
        if self.state is None or self.state.mode != "r3":
            return
        missing = [i for i, r in enumerate(records) if r.routed_experts is None]
        if missing:
            raise ValueError(
                f"rollout.routing_replay=r3: sample {missing[0]} (of {len(records)}) has no "
                "routed_experts; the engines must be asked for them (rollout.engine=sglang)"
            )
        missing = [i for i, r in enumerate(records) if self.state.indexers and r.indexer_topk is None]
        if missing:  # DSA: the indexer's selection is replayed too (trainer/route_replay.py)
            raise ValueError(
                f"rollout.routing_replay=r3: sample {missing[0]} (of {len(records)}) has no "
                "indexer_topk; a DSA model's engines must return it (return_indexer_topk)"
            )

    def recording(self) -> AbstractContextManager[object]:
        """Around the old-policy forward (:meth:`RouteReplay.recording`): r3 replays the engine's
        routes and counts agreement, r2 records the router's own."""
        return self.state.recording() if self.state is not None else nullcontext()

    def replaying(self) -> AbstractContextManager[object]:
        """Around the training forwards (:meth:`RouteReplay.replaying`): r3 replays the engine's
        routes, r2 the record of :meth:`recording`."""
        return self.state.replaying() if self.state is not None else nullcontext()

    def take_counts(self) -> dict[str, int]:
        """This rank's (token, layer) counts since the last call, by name (``trainer.step_metrics.STEP_SUMS``):
        ``route_agree`` / ``route_compared`` (top-k sets equal to the engine's, r3), ``indexer_agree``
        / ``indexer_compared`` (DSA indexer selections, r3); {} when off."""
        if self.state is None:
            return {}
        agree, compared = self.state.take_agreement()
        indexer_agree, indexer_compared = self.state.take_indexer_agreement()
        return {
            "route_agree": agree,
            "route_compared": compared,
            "indexer_agree": indexer_agree,
            "indexer_compared": indexer_compared,
        }


@dataclass(frozen=True)
class CurrentPolicy:
    """On-policy: the old log-probs are the trainer's forward with its current weights (the weights that
    generated the batch, draft included: ``drafts`` counts the MTP draft's acceptance in that forward)."""

    temperature: float
    fused_logprobs: bool
    drafts: bool = False

    def attach_old(self, model, batches: list[dict], records: list[Sample]) -> None:
        """batch["old_logprobs"] [b, s] for every batch."""
        attach_logprobs(model, batches, "old_logprobs", self.temperature, self.fused_logprobs, self.drafts)

    def trained(self) -> None:
        """Nothing to track."""


@dataclass(frozen=True)
class GeneratingPolicy:
    """Off-policy (``rollout.max_staleness`` >= 1): the old log-probs are the trainer's forward with
    the weights that generated each token (``history``; the records carry ``behaviour_version``)."""

    history: WeightHistory
    temperature: float
    fused_logprobs: bool
    drafts: bool = False

    def attach_old(self, model, batches: list[dict], records: list[Sample]) -> None:
        """batch["old_logprobs"] [b, s]: one forward per generating version
        (``WeightHistory.attach_old_logprobs``), or a single forward with the current weights when
        every token was generated by them; then the engine's log-prob on the tokens no single version
        sampled (``behaviour_policy.use_engine_behaviour``)."""
        current = self.history.current
        if any(int(v) != current for r in records for v in behaviour_versions(r)):
            self.history.attach_old_logprobs(model, batches, records, self.temperature, self.fused_logprobs)
        else:  # the draft's acceptance is counted only here, where one version generated every token
            attach_logprobs(model, batches, "old_logprobs", self.temperature, self.fused_logprobs, self.drafts)
        use_engine_behaviour(batches)  # in-place updates: tokens no single version sampled

    def trained(self) -> None:
        """The step's updates are done: the weights are the next policy version."""
        self.history.trained()


@dataclass(frozen=True)
class ReferenceModel:
    """The frozen KL reference (``gspo.kl_coef`` > 0), replaying the old forward's routes with its own
    :class:`RouteReplay` (``routing_replay``: the policy's mode; "off": none)."""

    model: torch.nn.Module
    routing_replay: str
    temperature: float
    fused_logprobs: bool

    def attach(self, batches: list[dict]) -> None:
        """batch["ref_logprobs"] [b, s] for every batch."""
        with replay_phase(self.model, self.routing_replay, "policy"):
            attach_logprobs(self.model, batches, "ref_logprobs", self.temperature, self.fused_logprobs)


class NoReference:
    """No KL reference model: no pass."""

    def attach(self, batches: list[dict]) -> None:
        """Nothing to attach."""


@dataclass(frozen=True)
class StepPasses:
    """The components of one step's passes (module docstring)."""

    replay: RoutingReplayPasses
    old_policy: CurrentPolicy | GeneratingPolicy
    reference: ReferenceModel | NoReference

    @classmethod
    def build(
        cls,
        model,
        *,
        routing_replay: str,
        temperature: float,
        fused_logprobs: bool,
        ref_model: torch.nn.Module | None = None,
        behaviour: WeightHistory | None = None,
        drafts: bool = False,
    ) -> StepPasses:
        """The passes of the policy ``model`` (its :class:`RouteReplay` is built on first use and kept
        on the model): ``routing_replay`` is ``rollout.routing_replay`` ("off", "r2", "r3"),
        ``temperature`` ``rollout.temperature``, ``fused_logprobs`` ``model.fused_logprobs``,
        ``ref_model`` the KL reference (None: none), ``behaviour`` the off-policy weight history (None:
        on-policy), ``drafts`` the model holds MTP layers (``model.mtp``: the old pass counts the
        draft's acceptance)."""
        old_policy: CurrentPolicy | GeneratingPolicy = (
            CurrentPolicy(temperature, fused_logprobs, drafts)
            if behaviour is None
            else GeneratingPolicy(behaviour, temperature, fused_logprobs, drafts)
        )
        reference: ReferenceModel | NoReference = (
            NoReference()
            if ref_model is None
            else ReferenceModel(ref_model, routing_replay, temperature, fused_logprobs)
        )
        return cls(RoutingReplayPasses(route_replay_for(model, routing_replay)), old_policy, reference)

    def check(self, records: list[Sample]) -> None:
        """Refuse records that a component cannot use (:meth:`RoutingReplayPasses.check`)."""
        self.replay.check(records)

    def logprobs(self, model, batches: list[dict], records: list[Sample]) -> None:
        """Passes 1 and 2: ``old_logprobs`` (recording the routes), then ``ref_logprobs`` (replaying
        them)."""
        with self.replay.recording():
            self.old_policy.attach_old(model, batches, records)
        self.reference.attach(batches)

    def training(self) -> AbstractContextManager[object]:
        """Pass 3's block: the training forwards replay what pass 1 recorded."""
        return self.replay.replaying()

    def trained(self) -> None:
        """After the step's optimizer steps."""
        self.old_policy.trained()
