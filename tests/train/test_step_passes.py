"""The training step's passes (``trainer.step_passes``) and its metrics by name (``trainer.step_metrics``).

The passes run on stand-in forwards that drive a real :class:`RouteReplay` (one router, no Megatron
model): a pass wired to the wrong replay block (the old forward replaying instead of recording, the
reference before the old forward, the training forwards outside the replay) fails here. The whole
step on a Megatron model: tests/pipeline/test_route_replay_r2.py. The metrics' reduction rules run
on two gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.trainer.packing import PAD_LABEL, ROUTES_KEY
from gspo_megatron.trainer.route_replay import R2_KEY, MaskedRouteReplay, RouteReplay
from gspo_megatron.trainer.step_metrics import STEP_SUMS, NamedSums
from gspo_megatron.trainer.step_passes import (
    CurrentPolicy,
    GeneratingPolicy,
    NoReference,
    ReferenceModel,
    RoutingReplayPasses,
    StepPasses,
)
from gspo_megatron.wire_format import NO_ROUTE

B, S, K, E = 2, 4, 2, 6


def _topk(scores, k, num_groups=None, group_topk=None):
    ids = scores.topk(k, dim=-1).indices
    return scores.gather(1, ids), ids


def _replay(mode: str) -> RouteReplay:
    """A RouteReplay of a model without routers, given one router of layer 0."""
    state = RouteReplay(torch.nn.Module(), mode)
    state.replays = [MaskedRouteReplay(0)]
    return state


def _batch() -> dict:
    labels = torch.tensor([[4, 5, PAD_LABEL, PAD_LABEL], [6, 7, 8, PAD_LABEL]])  # [b, s]
    routes = torch.full((B, S, 1, K), NO_ROUTE)
    routes[0, 0, 0], routes[0, 1, 0], routes[1, 0, 0], routes[1, 1, 0], routes[1, 2, 0] = (
        torch.tensor(r) for r in ([0, 1], [2, 3], [4, 5], [0, 5], [1, 2])
    )
    return {"labels": labels, ROUTES_KEY: routes}


class _Forwards:
    """Stand-in forwards: each runs the router through ``state``'s hooks and logs (pass, phase, targets, ids)."""

    def __init__(self, state: RouteReplay):
        self.state = state
        self.log: list[tuple[str, str | None, torch.Tensor | None, torch.Tensor]] = []
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, name: str, batch: dict) -> None:
        rep = self.state.replays[0]
        self.state.before_forward(batch)
        targets = rep.targets
        _, ids = rep.get_replay_topk(torch.randn(S * B, E, generator=self.gen), K, default_compute_topk=_topk)
        self.log.append((name, self.state.phase, targets, ids))
        self.state.after_forward(batch)


class _OldPolicy(_Forwards):
    def attach_old(self, model, batches, records) -> None:
        for b in batches:
            self.forward("old", b)

    def trained(self) -> None:
        self.log.append(("trained", self.state.phase, None, torch.empty(0)))


class _Reference:
    def __init__(self, forwards: _Forwards):
        self.forwards = forwards

    def attach(self, batches) -> None:
        for b in batches:
            assert R2_KEY in b or self.forwards.state.mode == "r3", "the reference ran without the old pass's record"
            self.forwards.log.append(("ref", self.forwards.state.phase, b.get(R2_KEY, {}).get(0), torch.empty(0)))


def _run_step(mode: str):
    state = _replay(mode)
    old = _OldPolicy(state)
    passes = StepPasses(RoutingReplayPasses(state), old, _Reference(old))
    batches = [_batch()]
    passes.logprobs(None, batches, [])
    counts = passes.replay.take_counts()
    with passes.training():
        for b in batches:
            old.forward("train", b)
    passes.trained()
    return state, old.log, batches, counts


def test_r2_step_records_in_the_old_pass_and_replays_it_in_training():
    state, log, (batch,), counts = _run_step("r2")
    assert [(name, phase) for name, phase, *_ in log] == [
        ("old", "old"),
        ("ref", None),
        ("train", "policy"),
        ("trained", None),
    ]
    (_, _, old_targets, old_ids), (_, _, ref_record, _), (_, _, train_targets, train_ids) = log[:3]
    assert old_targets is None  # the old forward routes by itself ...
    record = batch[R2_KEY][0]
    routed = (batch["labels"] != PAD_LABEL).T.reshape(-1)  # router order [s * b]
    assert torch.equal(record[routed], old_ids[routed]) and (record[~routed] == NO_ROUTE).all()  # ... and is recorded
    assert ref_record is record  # the reference sees the record
    assert train_targets is record and torch.equal(train_ids[routed], old_ids[routed])  # training replays it
    assert counts["route_compared"] == 0  # r2 compares nothing
    assert state.phase is None and state.replays[0].targets is None


def test_r3_step_counts_agreement_in_the_old_pass_only():
    state, log, (batch,), counts = _run_step("r3")
    assert [(name, phase) for name, phase, *_ in log] == [
        ("old", "old"),
        ("ref", None),
        ("train", "policy"),
        ("trained", None),
    ]
    routed = (batch[ROUTES_KEY][:, :, 0] != NO_ROUTE).all(-1).T.reshape(-1)
    for name, _, targets, ids in (log[0], log[2]):
        assert targets is not None, name  # both replay the engine's routes
        assert torch.equal(ids[routed], targets[routed]), name
    assert counts["route_compared"] == int(routed.sum()) == 5  # the old pass only, not the training one
    assert set(counts) <= set(STEP_SUMS)
    assert state.take_agreement() == (0, 0)  # taken once
    assert state.phase is None


def test_replay_blocks_restore_the_phase_when_a_pass_raises():
    state = _replay("r2")
    with pytest.raises(RuntimeError), state.recording():
        assert state.phase == "old"
        raise RuntimeError("forward failed")
    assert state.phase is None
    with state.replaying():
        with state.recording():
            assert state.phase == "old"
        assert state.phase == "policy"
    with pytest.raises(ValueError, match="phase must be one of"):
        with state.in_phase("new"):
            pass


def test_build_composes_the_enabled_components():
    from gspo_megatron.sample import Sample
    from gspo_megatron.trainer.behaviour_policy import WeightHistory

    model, ref = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    plain = StepPasses.build(model, routing_replay="off", temperature=1.0, fused_logprobs=False)
    assert plain.replay.state is None and isinstance(plain.reference, NoReference)
    assert plain.old_policy == CurrentPolicy(1.0, False)
    assert plain.replay.take_counts() == {}
    history = WeightHistory(model, 1, 0)
    full = StepPasses.build(
        model, routing_replay="r3", temperature=0.7, fused_logprobs=True, ref_model=ref, behaviour=history
    )
    assert isinstance(full.old_policy, GeneratingPolicy) and full.old_policy.history is history
    assert full.reference == ReferenceModel(ref, "r3", 0.7, True)
    assert isinstance(full.replay.state, RouteReplay) and full.replay.state.mode == "r3"
    again = StepPasses.build(model, routing_replay="r3", temperature=0.7, fused_logprobs=True)
    assert again.replay.state is full.replay.state  # one RouteReplay per model
    with pytest.raises(ValueError, match="routed_experts"):
        full.check([Sample.from_tokens([1, 2, 3], 2)])
    full.trained()
    assert history.current == 1


def test_named_sums_by_name():
    sums = NamedSums(STEP_SUMS, torch.device("cpu"))
    sums["route_agree"] = 3
    sums.add("engine_gap", torch.tensor(0.25, dtype=torch.float64))
    sums.add("engine_gap", 0.5)
    assert float(sums["engine_gap"]) == 0.75 and float(sums["route_agree"]) == 3.0
    assert sums.values.tolist() == [0.75, 0, 0, 0, 3.0, 0, 0, 0, 0, 0]
    with pytest.raises(KeyError, match="no slot named 'engine_gaps'"):
        sums.add("engine_gaps", 1.0)
    with pytest.raises(ValueError, match="distinct"):
        NamedSums(("a", "a"), torch.device("cpu"))


def _reduce_worker(rank: int, world: int):
    import torch.distributed as dist

    from gspo_megatron.trainer.step_metrics import old_pass_sums, reduce_loss_metrics, step_sum_metrics

    dist.init_process_group("gloo")
    # rank 0 reports two mini-batches' micro-batches, rank 1 one micro-batch (and no entropy)
    per_rank = {
        0: [
            [
                {
                    "num_seqs": 2.0,
                    "loss": 0.5,
                    "pg_loss": 0.4,
                    "ratio_mean": 1.0,
                    "entropy": 2.0,
                    "ratio_min": 0.9,
                    "ratio_max": 1.1,
                }
            ],
            [{"num_seqs": 0.0, "loss": 0.25, "ratio_mean": 7.0, "ratio_min": 0.1, "ratio_max": 9.0}],
        ],
        1: [
            [{"num_seqs": 1.0, "loss": 1.0, "pg_loss": 1.0, "ratio_mean": 4.0, "ratio_min": 0.8, "ratio_max": 1.3}],
            [],
        ],
    }[rank]
    metrics = reduce_loss_metrics(per_rank, 2)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    flat = [
        {
            "old_logprobs": torch.tensor([[-1.0, -2.0, 5.0]]),
            "engine_logprobs": torch.tensor([[-1.5, -1.0, 0.0]]),
            "loss_mask": mask,
            "num_computed_tokens": 8,
            "num_real_tokens": 6,
        }
    ]
    counts = {"route_agree": 3, "route_compared": 4} if rank == 0 else {"route_agree": 1, "route_compared": 4}
    sums = old_pass_sums(flat, counts, gap_reporter=True, reporter=rank == 0)
    metrics.update(step_sum_metrics(sums.all_reduce()))
    return metrics


def test_reduction_rules_over_ranks():
    for m in run_ranks(_reduce_worker, 2):
        assert list(m) == [
            "gspo/ratio_mean",
            "policy/entropy",
            "loss/total",
            "loss/policy",
            "gspo/ratio_min",
            "gspo/ratio_max",
            "train/num_seqs",
            "rollout/logprob_abs_diff",
            "perf/padding_frac",
            "rollout/route_agreement",
        ]
        assert m["gspo/ratio_mean"] == pytest.approx((2 * 1.0 + 1 * 4.0) / 3)  # num_seqs-weighted
        assert m["policy/entropy"] == pytest.approx(2 * 2.0 / 3)  # reported by one rank: over every sequence
        assert m["loss/total"] == pytest.approx((0.5 + 0.25 + 1.0) / 2)  # summed, averaged over mini-batches
        assert m["loss/policy"] == pytest.approx((0.4 + 1.0) / 2)
        assert (m["gspo/ratio_min"], m["gspo/ratio_max"]) == (0.8, 1.3)  # empty micro-batches do not count
        assert m["train/num_seqs"] == 3.0
        assert m["rollout/logprob_abs_diff"] == pytest.approx((0.5 + 1.0) * 2 / 4)  # both ranks' gap tokens
        assert m["perf/padding_frac"] == pytest.approx(1 - 6 / 8)  # rows counted once (rank 0)
        assert m["rollout/route_agreement"] == pytest.approx(4 / 8)
        assert not any(math.isnan(v) for v in m.values())
