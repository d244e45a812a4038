"""Owner-direct routing (weight_sync/owner_direct.py) on its own: which ranks hold each routed expert
tensor and whom they serve, the engine rounds every rank derives from a bucket's routes, and the
config's refusals. The assembled path (gspo-train, engines checked bitwise) is in
tests/train/test_sync_owner_direct_run.py and tests/topology/test_multinode.py."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.models.export_plan import _Item
from gspo_megatron.weight_sync.buckets import FlatBucket
from gspo_megatron.weight_sync.owner_direct import OwnerDirectIpcTransport, OwnerDirectRouting


def _item(name: str, owner: int) -> _Item:
    return _Item((0,), name, (name,), ((4, 4),), torch.float32, owner)


def _routing(engines: int, tp: int, nodes: list[int], ep: int, experts: int = 8) -> OwnerDirectRouting:
    specs = [SimpleNamespace(index=e, train_ranks=tuple(range(e * tp, (e + 1) * tp))) for e in range(engines)]
    return OwnerDirectRouting(specs, nodes, ep, experts)


def test_dense_tensors_go_to_every_rank():
    r = _routing(2, 2, [0, 0, 1, 1], 1)
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.shared_expert.up_proj.weight",
    ):
        assert r.holders(_item(name, 0), local=False) is None


def test_without_engine_ep_the_owner_serves_its_node_and_one_rank_per_other_node_receives():
    # 4 ranks on 2 nodes, 2 engines of TP 2 (one per node), every engine rank loads every expert
    r = _routing(2, 2, [0, 0, 1, 1], 1)
    got = r.holders(_item("model.layers.0.mlp.experts.5.down_proj.weight", owner=1), local=False)
    assert got == {1: ((0, 0), (0, 1)), 3: ((1, 0), (1, 1))}  # node 1's rank 2 + 5 % 2 receives it
    got = r.holders(_item("model.layers.0.mlp.experts.4.down_proj.weight", owner=1), local=False)
    assert got == {1: ((0, 0), (0, 1)), 2: ((1, 0), (1, 1))}  # the next expert: its other rank


def test_with_engine_ep_only_the_ranks_of_the_experts_ep_rank_get_it():
    # one engine of TP 4 over 2 nodes with --ep-size 2: TP ranks 0-1 hold experts 0-3, 2-3 hold 4-7
    r = _routing(1, 4, [0, 0, 1, 1], 2)
    assert r.holders(_item("model.layers.0.mlp.experts.2.up_proj.weight", owner=3), local=False) == {
        0: ((0, 0), (0, 1))
    }
    assert r.holders(_item("model.layers.0.mlp.experts.6.up_proj.weight", owner=3), local=False) == {
        3: ((0, 2), (0, 3))
    }
    # engine_ep = engine_tp: one TP rank per expert range
    r4 = _routing(1, 4, [0, 0, 1, 1], 4)
    assert r4.holders(_item("model.layers.1.mlp.experts.7.gate_proj.weight", owner=0), local=False) == {3: ((0, 3),)}


def test_items_every_rank_assembles_are_held_by_each_rank_that_needs_them():
    r = _routing(1, 2, [0, 0], 2, experts=4)
    assert r.holders(_item("model.layers.0.mlp.experts.3.up_proj.weight", owner=0), local=True) == {1: ((0, 1),)}


def test_engine_ep_must_divide_the_experts_and_the_engine_tp():
    with pytest.raises(ValueError, match="rollout.engine_ep=3 must divide rollout.engine_tp=2"):
        _routing(1, 2, [0, 0], 3)
    with pytest.raises(ValueError, match="rollout.engine_ep=2 must divide the model's 5 routed experts"):
        _routing(1, 2, [0, 0], 2, experts=5)


def _rounds(routing: OwnerDirectRouting, rank: int, routes) -> tuple[dict, int]:
    t = OwnerDirectIpcTransport.__new__(OwnerDirectIpcTransport)  # only what _rounds reads
    t.routing, t.slot = routing, routing.slot_of[rank]
    bucket = FlatBucket()
    bucket.routes = routes
    return t._rounds(bucket)


def test_every_rank_derives_the_same_rounds_and_pads_its_own_slot():
    r = _routing(2, 2, [0, 0, 1, 1], 1)
    expert = r.holders(_item("model.layers.0.mlp.experts.4.down_proj.weight", owner=1), local=False)
    # a bucket with a dense tensor and that expert: engine 0's TP rank 0 gets its own rank's payload
    # and rank 1's (2 rounds), TP rank 1 only its own (holder of both: 1 payload, 1 empty)
    assert _rounds(r, 0, [None, expert]) == ({(0, 0): 2, (0, 1): 2}, 2)
    assert _rounds(r, 1, [None, expert]) == ({(0, 0): 2, (0, 1): 2}, 1)
    # node 1: rank 2 received the copy; rank 3 reads it: both slots 2 payloads
    assert _rounds(r, 3, [None, expert]) == ({(1, 0): 2, (1, 1): 2}, 2)
    # experts only: rank 3 gets nothing from itself, one payload from rank 2
    assert _rounds(r, 3, [expert]) == ({(1, 0): 1, (1, 1): 1}, 1)
    assert _rounds(r, 0, []) == ({(0, 0): 0, (0, 1): 0}, 0)


def test_the_config_refuses_owner_direct_outside_colocated():
    from gspo_megatron.config import load_config
    from gspo_megatron.errors import ConfigError

    demo = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo_cpu.yaml")
    base = ["rollout.engine=sglang", "rollout.engine_server=cpu", "rollout.sync_owner_direct=true"]
    with pytest.raises(ConfigError, match="rollout.sync_owner_direct=true needs rollout.sync_mode=colocated"):
        load_config(demo, [*base, "rollout.sync_mode=disaggregated", "rollout.num_engines=1"])
    cfg = load_config(demo, [*base, "rollout.sync_mode=colocated"])
    assert cfg.rollout.sync_owner_direct is True


def test_an_expert_dp_replica_on_the_node_holds_it_instead_of_a_transfer():
    r = _routing(2, 2, [0, 0, 1, 1], 1)
    it = _Item((0,), "x", ("model.layers.0.mlp.experts.5.down_proj.weight",), ((4, 4),), torch.float32, 1, copies=(3,))
    assert r.holders(it, local=False) == {1: ((0, 0), (0, 1)), 3: ((1, 0), (1, 1))}
