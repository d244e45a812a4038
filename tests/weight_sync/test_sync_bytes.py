"""bench/sync_bytes.py's byte model (bench/sync_model.py, re-exported by sync_bytes) against the real
export plan: on gloo worlds (pp2, pp2 x ep2) with a tiny Qwen3-MoE, the bytes each rank owns in
``build_export_plan`` and the bytes each stage source receives under the disaggregated routing
(``topology.stage_sources``) equal the model's formula (planner parameter counts, Megatron's rank
order); the built owner-direct routing's holders equal ``OwnerDirectRouting``'s and its senders
``weight_sync.buckets._routed``'s rule; plus the ring, link and owner-direct accounting by hand."""

import importlib.util
import os
import re
import sys
from fractions import Fraction
from types import SimpleNamespace

import pytest

from distributed_harness import run_ranks

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "sync_bytes.py")


def _sync_bytes():
    spec = importlib.util.spec_from_file_location("sync_bytes", _BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sync_bytes"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _plan_worker(rank, world, hf_dir, layout):
    from gspo_megatron.models.build import build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import build_export_plan
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.weight_sync.topology import stage_sources

    init_distributed(ParallelLayout(**layout))
    model = build_model(
        load_hf_config(hf_dir), layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1), layout.get("etp")
    )
    items, _ = build_export_plan(model)
    stage_of, sources = stage_sources()
    owned, to_source = {}, {}
    for it in items:
        owned[it.owner] = owned.get(it.owner, 0) + it.nbytes
        src = sources[stage_of[it.owner]]
        to_source[src] = to_source.get(src, 0) + it.nbytes
    senders = {(it.owner, *it.copies) for it in items if it.copies}  # as ``weight_sync.buckets._routed`` forms them
    return owned, to_source, {it.dtype.itemsize for it in items}, senders


@pytest.mark.parametrize(
    "layout,world", [({"pp": 2}, 2), ({"pp": 2, "ep": 2}, 4), ({"ep": 2}, 4)], ids=["pp2", "pp2ep2", "ep2edp2"]
)
def test_owner_and_source_bytes_equal_the_export_plan(tmp_path, layout, world):
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from gspo_megatron.planner import ModelDims

    sb = _sync_bytes()
    save_tiny_hf_model("qwen3_moe", str(tmp_path))
    owned, to_source, itemsizes, senders = run_ranks(_plan_worker, world, str(tmp_path), layout)[0]
    assert len(itemsizes) == 1
    hf = load_hf_config(str(tmp_path))
    # transformers 5 writes num_local_experts; the planner reads num_experts (as the published configs have)
    hf.setdefault("num_experts", hf.get("num_local_experts"))
    dims = ModelDims.from_hf_config(hf)
    lay = sb.Layout(world=world, gpus_per_node=2, pp=layout.get("pp", 1), ep=layout.get("ep", 1))
    stages = sb.stage_bytes(dims, lay.pp, itemsizes.pop())
    assert sb.owner_bytes(stages, lay) == owned
    assert sb.source_bytes(stages, lay) == to_source
    assert len(to_source) == lay.pp and min(to_source.values()) > 0
    # the ranks holding an expert whole, in the order the built owner-direct routing picks its senders
    # from (the owner, then the expert-DP replicas ascending): the model's ``BuiltRoute.copies``
    holders = [sb.expert_holders(lay, s, k) for s in range(lay.pp) for k in range(lay.ep)]
    assert senders == {tuple(h) for h in holders if len(h) > 1}
    assert senders == {r.copies for r in sb.built_expert_routes(lay) if len(r.copies) > 1}
    assert bool(senders) == (layout == {"ep": 2})  # only ep2 on 4 ranks has expert-DP 2


def test_ring_accounting_by_hand():
    sb = _sync_bytes()
    lay = sb.Layout(world=4, gpus_per_node=2, tp=2, pp=2, ep=1, etp=1, engines=1, engine_tp=3)
    stages = [sb.StageBytes(100, 10, 40), sb.StageBytes(60, 6, 20)]
    sent, nodes, local = sb.traffic(stages, lay, "disaggregated")
    # TP gather: each of the 2 members sends half of T_s; source rings B_s to 3 engine GPUs
    assert sent[0] == 50 + 150 and sent[2] == 30 + 86 and sent[1] == 50 and sent[3] == 30
    assert sent[("engine", 0)] == sent[("engine", 1)] == 150 + 86 and ("engine", 2) not in sent
    assert nodes[0] == 150 and nodes[1] == 86  # source -> first engine GPU leaves the node
    assert local == {}
    sent, nodes, local = sb.traffic(stages, lay, "colocated")
    # owners 0 (150 B) and 2 (86 B) broadcast over ranks 0..3 in ring order; root r's chain ends at r-1
    # chain from 0: 0,1,2,3 (3 ends it); chain from 2: 2,3,0,1 (1 ends it); plus the TP gathers
    assert sent == {0: 50 + 150 + 86, 1: 50 + 150, 2: 30 + 150 + 86, 3: 30 + 86}
    assert nodes == {0: 150, 1: 86}  # the edges 1 -> 2 (root 0) and 3 -> 0 (root 2) leave their nodes
    assert local == {r: 236 for r in range(4)}


def test_time_model_closed_forms():
    sb = _sync_bytes()
    cl = sb.Cluster()
    assert sb.transfer_seconds(1e9, 50.0) == pytest.approx(0.02)  # 1 GB over one NDR NIC
    # index (int32 + bf16 = 6 B per change) below 1/32 changed, bitmask above, never above full
    assert sb.delta_wire_bytes(1e6, 0.01, 2) == pytest.approx(1e4 * 6)
    assert sb.delta_wire_bytes(1e6, 0.5, 2) == pytest.approx(1e6 / 8 + 5e5 * 2)
    assert sb.delta_ratio(0.0005, 2) == pytest.approx(0.0015) and sb.delta_ratio(1.0, 2) == 1.0
    # a ring broadcast of 1 GB over two full nodes: the node hop on 8 rails (1/8 GB per NIC, 8 x 50 GB/s
    # < 450 GB/s NVLink: IB is the bottleneck); one node: NVLink
    load = sb.LinkLoad(cl, 8)
    load.ring_broadcast(list(range(16)), 0, 1e9)
    t, key, b = load.bottleneck()
    assert key[1] == "ib" and b == pytest.approx(1e9 / 8) and t == pytest.approx(1e9 / 400e9)
    assert load.bytes[(7, "ib", "out")] == pytest.approx(1e9 / 8)
    load = sb.LinkLoad(cl, 8)
    load.ring_broadcast(list(range(8)), 0, 1e9)
    assert load.bottleneck()[1][1] == "nvlink" and load.bottleneck()[0] == pytest.approx(1e9 / 450e9)
    # a lone source on its node: one rail, 1 GB / 50 GB/s
    load = sb.LinkLoad(cl, 8)
    load.ring_broadcast([0] + [("engine", i) for i in range(8)], 0, 1e9)
    assert load.bottleneck()[0] == pytest.approx(0.02) and load.bottleneck()[1][1] == "ib"


def test_time_model_bottleneck_colocated_vs_disaggregated():
    sb = _sync_bytes()
    cl = sb.Cluster()
    lay = sb.Layout(world=8, gpus_per_node=8, tp=1, pp=1, ep=8, engines=1, engine_tp=8)
    stages = [sb.StageBytes(1_000_000_000, 0, 8_000_000_000)]  # 9 GB: 1 GB dense, 1 GB per expert owner
    # colocated on one node: every transfer on NVLink; owner-direct sends the experts p2p (7/8 GB out
    # of each owner) and rings the dense 1 GB
    t, key, b = sb.full_sync_load(stages, lay, "colocated", cl).bottleneck()
    # each rank forwards every owner's bytes but those of the root after it (9 - 1 GB)
    assert key[1] == "nvlink" and b == pytest.approx(8e9) and t == pytest.approx(8e9 / 450e9)
    t, key, b = sb.owner_direct_load(stages, lay, "colocated", cl).bottleneck()
    assert key[1] == "nvlink" and b == pytest.approx(1e9 + 7e9 / 8)
    # disaggregated: the stage source's NIC carries the whole model once (one rail), 9 GB / 50 GB/s
    t, key, b = sb.full_sync_load(stages, lay, "disaggregated", cl).bottleneck()
    assert key[1] == "ib" and t == pytest.approx(9e9 / 50e9)
    # owner-direct disaggregated: each expert owner's NIC sends its 1 GB, the source also rings 1 GB dense
    t, key, b = sb.owner_direct_load(stages, lay, "disaggregated", cl).bottleneck()
    assert key == (0, "ib", "out") and b == pytest.approx(2e9)
    # delta from the owners: the PCIe read of the owner's bytes (2 GB at 55 GB/s) bounds it
    t, key, b = sb.delta_owner_load(stages, lay, "disaggregated", cl, sb.delta_ratio(0.0005, 2)).bottleneck()
    assert key == (0, "pcie", "out") and t == pytest.approx(2e9 / 55e9)
    # delta as built, disaggregated (weight_sync/delta_http.py): the source reads its stage (9 GB) over
    # PCIe, writes the changes once (r x 9 GB out of its NIC), every engine GPU reads them (r x 9 GB in)
    r = sb.delta_ratio(0.0179, 2)
    load = sb.delta_http_load(stages, lay, cl, r)
    t, key, b = load.bottleneck()
    assert key == (0, "pcie", "out") and t == pytest.approx(9e9 / 55e9)
    assert load.bytes[(0, "ib", "out")] == pytest.approx(9e9 * r)  # the owners' p2p stays on NVLink (one node)
    assert all(load.bytes[(("engine", i), "ib", "in")] == pytest.approx(9e9 * r) for i in range(8))


def test_main_prints_a_row_per_mode(capsys):
    sb = _sync_bytes()
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    sb.main([os.path.join(root, "configs", "qwen3_30b_a3b_gspo.yaml"), "--ib-gbps", "25"])
    out = capsys.readouterr().out
    assert "InfiniBand 25 GB/s" in out and "modelled, not measured" in out
    rows = [
        re.split(r"\s{2,}", line.strip()) for line in out.splitlines() if line.strip().startswith("qwen3_30b_a3b_gspo ")
    ]
    modes = [f"{row[2]} {row[3]}" for row in rows]
    assert modes == [
        "colocated full (built)",
        "colocated owner-direct (built)",
        "colocated owner-direct (designed)",
        "colocated delta 1.79% (built)",
        "colocated delta 1.79% owner",
        "colocated delta 0.05% (built)",
        "colocated delta 0.05% owner",
        "disaggregated full (built)",
        "disaggregated owner-direct (designed)",
        "disaggregated delta 1.79% (built)",
        "disaggregated delta 1.79% owner",
        "disaggregated delta 0.05% (built)",
        "disaggregated delta 0.05% owner",
    ]
    assert "TP8 EP1" in out  # the recipe's rollout.engine_ep, read by recipe_layout


def _links(load) -> dict:
    """{(gpu, link, direction): bytes} without the zero entries of a load."""
    return {k: v for k, v in load.bytes.items() if v}


def _sent(load) -> float:
    """Bytes sent over every link of a load (each transfer once: its "out" ends)."""
    return sum(v for (_, _, direction), v in load.bytes.items() if direction == "out")


def _dense_ring_from_0() -> dict:
    """The world ring broadcast of 64 dense bytes from rank 0 on 2 nodes x 2 GPUs: 0 -> 1 and 2 -> 3 on
    NVLink, 1 -> 2 across the nodes on 2 rails (32 B per NIC)."""
    return {
        (0, "nvlink", "out"): 64,
        (1, "nvlink", "in"): 64,
        (2, "nvlink", "out"): 64,
        (3, "nvlink", "in"): 64,
        (0, "ib", "out"): 32,
        (1, "ib", "out"): 32,
        (2, "ib", "in"): 32,
        (3, "ib", "in"): 32,
    }


def _plus(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = out.get(k, 0) + v
    return out


def test_owner_direct_built_closed_forms():
    """2 nodes x 2 GPUs, ep4 (owners: ranks 0-3, one shard of 250 B each, no expert-DP replica),
    2 colocated engines of TP2 (ranks 0-1, 2-3); one stage of 64 dense + 1000 expert bytes."""
    sb = _sync_bytes()
    cl = sb.Cluster()
    lay = sb.Layout(world=4, gpus_per_node=2, ep=4, engines=2, engine_tp=2)
    stages = [sb.StageBytes(60, 4, 1000)]
    # engine_ep 1, 4 experts (shard k = expert k): every engine rank loads every shard and reads its half
    # (125 B) of each from its node's holder. Node 0 (needing ranks [0, 1]) holds shards 0, 1 at their
    # owners and receives expert 2 on ranks[2 % 2] = 0, expert 3 on ranks[3 % 2] = 1; node 1 ([2, 3])
    # receives expert 0 on rank 2, expert 1 on rank 3: each rank's NIC takes one shard
    load = sb.owner_direct_built_load(stages, lay, cl, engine_ep=1, num_experts=4)
    assert _links(load) == pytest.approx(
        _plus(
            _dense_ring_from_0(),
            {
                (0, "ib", "out"): 250,  # shard 0 -> rank 2
                (1, "ib", "out"): 250,  # shard 1 -> rank 3
                (2, "ib", "out"): 250,  # shard 2 -> rank 0
                (3, "ib", "out"): 250,  # shard 3 -> rank 1
                (0, "ib", "in"): 250,
                (1, "ib", "in"): 250,
                (2, "ib", "in"): 250,
                (3, "ib", "in"): 250,
                (0, "nvlink", "out"): 250,  # rank 1 reads shards 0, 2 from rank 0
                (1, "nvlink", "in"): 250,
                (1, "nvlink", "out"): 250,  # rank 0 reads shards 1, 3 from rank 1
                (0, "nvlink", "in"): 250,
                (2, "nvlink", "out"): 250,  # rank 3 reads shards 2, 0 from rank 2
                (3, "nvlink", "in"): 250,
                (3, "nvlink", "out"): 250,  # rank 2 reads shards 3, 1 from rank 3
                (2, "nvlink", "in"): 250,
            },
        )
    )
    assert sb.node_egress(load) == pytest.approx({0: 564, 1: 500})  # each missing shard once + the dense ring
    # the busiest link: 250 B of shards + 32 B of the dense ring's node hop on each rank's NIC (0, 1 out;
    # 2, 3 in); 314 B out of rank 0's NVLink is 314 / 450 < 282 / 50
    t, key, b = load.bottleneck()
    assert key[1] == "ib" and b == pytest.approx(282) and t == pytest.approx(282 / 50e9)
    # without the expert count each needing rank of a node holds half of each missing shard: here the
    # same bytes per link (rank 0 takes half of shards 2 and 3 instead of all of shard 2)
    assert _links(sb.owner_direct_built_load(stages, lay, cl, engine_ep=1)) == pytest.approx(_links(load))
    # an engine rank that read the whole tensor (not sglang's narrowed slice) doubles the NVLink reads
    full = sb.owner_direct_built_load(stages, lay, cl, engine_ep=1, full_reads=True, num_experts=4)
    assert full.bytes[(0, "nvlink", "out")] == pytest.approx(64 + 500)
    # engine_ep 2: engine TP rank 0 (ranks 0, 2) loads shards 0, 1, TP rank 1 (ranks 1, 3) shards 2, 3,
    # whole (slice 1/1), one needing rank per node and EP rank. Shard 1's holder on node 0 is its owner,
    # rank 1, which rank 0 reads; shards 2, 3 go to node 0's needer rank 1; node 1 likewise (0, 1 ->
    # rank 2; rank 3 reads shard 2 from 2)
    load2 = sb.owner_direct_built_load(stages, lay, cl, engine_ep=2, num_experts=4)
    assert _links(load2) == pytest.approx(
        _plus(
            _dense_ring_from_0(),
            {
                (0, "ib", "out"): 250,
                (1, "ib", "out"): 250,
                (2, "ib", "out"): 250,
                (3, "ib", "out"): 250,
                (1, "ib", "in"): 500,
                (2, "ib", "in"): 500,
                (1, "nvlink", "out"): 250,
                (0, "nvlink", "in"): 250,
                (2, "nvlink", "out"): 250,
                (3, "nvlink", "in"): 250,
            },
        )
    )
    assert _sent(load) == pytest.approx(128 + 64 + 1000 + 1000) and _sent(load2) == pytest.approx(128 + 64 + 1000 + 500)
    # the layout's engine_ep is the default
    lay2 = sb.Layout(world=4, gpus_per_node=2, ep=4, engines=2, engine_tp=2, engine_ep=2)
    assert _links(sb.owner_direct_built_load(stages, lay2, cl, num_experts=4)) == pytest.approx(_links(load2))
    with pytest.raises(ValueError, match="rollout.engine_ep=3"):
        sb.owner_direct_built_load(stages, lay, cl, engine_ep=3)
    with pytest.raises(ValueError, match="the 6 experts"):
        sb.owner_direct_built_load(stages, lay, cl, engine_ep=1, num_experts=6)  # ep4 does not divide 6


def test_owner_direct_built_reads_expert_dp_replicas():
    """ep2 on 2 nodes x 2 GPUs: expert-DP replicas of shards 0, 1 on ranks 2, 3 (node 1) hold them whole
    (etp 1), so no expert byte leaves node 0; with etp 2 there is no replica and each node's needing
    ranks receive the shard it lacks, by expert index."""
    sb = _sync_bytes()
    cl = sb.Cluster()
    stages = [sb.StageBytes(60, 4, 1000)]
    lay = sb.Layout(world=4, gpus_per_node=2, ep=2, engines=2, engine_tp=2)
    load = sb.owner_direct_built_load(stages, lay, cl, engine_ep=1, num_experts=2)
    assert sb.node_egress(load) == pytest.approx({0: 64})
    # each rank reads its half (250 B) of the other shard from the rank beside it
    assert load.bytes[(2, "nvlink", "out")] == pytest.approx(64 + 250) and load.bytes[(3, "nvlink", "out")] == 250
    lay_etp = sb.Layout(world=4, gpus_per_node=2, ep=2, etp=2, engines=2, engine_tp=2)
    # owners 0 (shard 0 = expert 0) and 2 (shard 1 = expert 1): node 0 ([0, 1]) receives expert 1 on
    # ranks[1 % 2] = 1, node 1 ([2, 3]) expert 0 on ranks[0 % 2] = 2; the ETP gathers stay in the nodes
    load = sb.owner_direct_built_load(stages, lay_etp, cl, engine_ep=1, num_experts=2)
    assert sb.node_egress(load) == pytest.approx({0: 500 + 64, 1: 500})
    ib_in = {g: load.bytes[(g, "ib", "in")] for g in range(4)}
    assert ib_in == pytest.approx({0: 0, 1: 500, 2: 500 + 32, 3: 32})  # + the dense ring's hop on 2 rails
    # NVLink out: the ETP all-gathers ([0, 1], [2, 3]: half of a shard, 250 B, from each member), the
    # dense ring (64 B from 0 and 2), and the reads of half a shard (250 B): rank 1 reads shard 0 from
    # rank 0, rank 0 shard 1 from rank 1; node 1's holder of both shards is rank 2 (shard 1's owner,
    # expert 0's receiver), from which rank 3 reads both
    nvl_out = {g: load.bytes[(g, "nvlink", "out")] for g in range(4)}
    assert nvl_out == pytest.approx({0: 250 + 64 + 250, 1: 250 + 250, 2: 250 + 64 + 500, 3: 250})
    # 4 experts (shard 1 = experts 2, 3 -> ranks 0, 1), or the count not known (equal shares): 250 B each
    for n in (4, None):
        load = sb.owner_direct_built_load(stages, lay_etp, cl, engine_ep=1, num_experts=n)
        assert [load.bytes[(g, "ib", "in")] for g in range(4)] == pytest.approx([250, 250, 250 + 32, 250 + 32])


def test_owner_direct_built_replicas_send():
    """4 nodes x 2 GPUs, ep4 etp1: expert-DP 2, so shard k (= expert k of 4) sits whole on its owner k
    and its replica k + 4: shards 0, 1 on nodes 0 and 2, shards 2, 3 on nodes 1 and 3. Four colocated
    engines of TP2 (one per node), engine_ep 1: every node loads every shard, and a node lacking shard k
    takes it on ranks[k % 2], so a shard's two receivers share a residue mod 2 (shard 0: ranks 2, 6;
    1: 3, 7; 2: 0, 4; 3: 1, 5). ``weight_sync.buckets._routed`` gives the first receiver (ascending) the
    owner's copy and the second the replica's: every rank sends one shard over InfiniBand and takes in
    one (``copies[holder % 2]`` would send both from one copy: ranks 0, 5, 2, 7 twice, the others
    never). One stage of 64 dense + 1200 expert bytes (300 per shard)."""
    sb = _sync_bytes()
    cl = sb.Cluster()
    lay = sb.Layout(world=8, gpus_per_node=2, ep=4, engines=4, engine_tp=2)
    stages = [sb.StageBytes(60, 4, 1200)]
    routes = sb.built_expert_routes(lay, 1, num_experts=4)
    assert [r.copies for r in routes] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # the receivers' nodes, ascending: shards 0, 1 -> nodes 1, 3; shards 2, 3 -> nodes 0, 2
    lacking = [(1, 3), (1, 3), (0, 2), (0, 2)]
    assert [(r.sender(a), r.sender(b)) for r, (a, b) in zip(routes, lacking)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    load = sb.owner_direct_built_load(stages, lay, cl, engine_ep=1, num_experts=4)
    # p2p across nodes, 300 B each: 0 -> 2, 4 -> 6 (shard 0), 1 -> 3, 5 -> 7, 2 -> 0, 6 -> 4, 3 -> 1, 7 -> 5.
    # The dense ring from 0 over ranks 0-7: 0 -> 1, 2 -> 3, 4 -> 5, 6 -> 7 on NVLink (64 B), the node hops
    # 1 -> 2, 3 -> 4, 5 -> 6 on 2 rails (32 B per NIC: out of ranks 0-5, into ranks 2-7). Each even rank
    # holds shards 0, 2 (copy or received), each odd one 1, 3, and reads its half (150 B) of the other two
    # from the rank beside it: 300 B each way over NVLink
    ib_out = {(g, "ib", "out"): 300 + (32 if g < 6 else 0) for g in range(8)}
    ib_in = {(g, "ib", "in"): 300 + (32 if g >= 2 else 0) for g in range(8)}
    nvl_out = {(g, "nvlink", "out"): 300 + (64 if g % 2 == 0 else 0) for g in range(8)}
    nvl_in = {(g, "nvlink", "in"): 300 + (64 if g % 2 else 0) for g in range(8)}
    assert _links(load) == pytest.approx({**ib_out, **ib_in, **nvl_out, **nvl_in})
    assert sb.node_egress(load) == pytest.approx({0: 664, 1: 664, 2: 664, 3: 600})
    # the busiest link: one shard + a dense rail (332 B); senders by holder rank would put 632 B on rank 0's
    t, key, b = load.bottleneck()
    assert key[1] == "ib" and b == pytest.approx(332) and t == pytest.approx(332 / 50e9)
    # 3 nodes x 2 GPUs, ep3: shard k on k and k + 3, each lacking on one node (shard 0 on node 2's rank 4,
    # 1 on node 1's rank 3, 2 on node 0's rank 0): a lone receiver takes the owner's copy (by holder rank,
    # rank 3 would take shard 1 from replica 4). Dense ring 0-5: 32 B out of ranks 0-3 (hops 1 -> 2, 3 -> 4)
    lay3 = sb.Layout(world=6, gpus_per_node=2, ep=3, engines=3, engine_tp=2)
    load3 = sb.owner_direct_built_load([sb.StageBytes(60, 4, 900)], lay3, cl, engine_ep=1, num_experts=3)
    assert [load3.bytes[(g, "ib", "out")] for g in range(6)] == pytest.approx([332, 332, 332, 32, 0, 0])


def test_built_route_holdings():
    """``BuiltRoute.holdings``: the share of a route's bytes each holder keeps, from ``holders_of``.
    ep2 etp2 on 2 nodes x 2 GPUs (no replica), one engine of TP4, 6 experts: shard 1 = experts 3, 4, 5,
    which node 0 ([0, 1]) lacks: 3 -> rank 1, 4 -> rank 0, 5 -> rank 1; node 1 has the owner, rank 2."""
    sb = _sync_bytes()
    lay = sb.Layout(world=4, gpus_per_node=2, ep=2, etp=2, engines=1, engine_tp=4)
    (route,) = [r for r in sb.built_expert_routes(lay, 1, num_experts=6) if r.shard == 1]
    assert route.experts == (3, 4, 5) and route.copies == (2,)
    assert route.holders_of(4) == {0: (0, 1), 2: (2, 3)} and route.holders_of(5) == {1: (0, 1), 2: (2, 3)}
    assert route.holdings() == {0: (Fraction(1, 3), (0, 1)), 1: (Fraction(2, 3), (0, 1)), 2: (1, (2, 3))}
    (unknown,) = [r for r in sb.built_expert_routes(lay, 1) if r.shard == 1]
    assert unknown.experts == () and unknown.holdings() == {
        0: (Fraction(1, 2), (0, 1)),
        1: (Fraction(1, 2), (0, 1)),
        2: (1, (2, 3)),
    }


def test_owner_direct_built_engine_spanning_nodes():
    """One engine of TP4 over both nodes, ep4 (owners 0-3, no replicas): with engine_ep 2 node 0's
    ranks load only shards 0, 1 (owned on node 0) and node 1's only 2, 3, so no expert byte leaves a
    node; with engine_ep 1 each node receives the other node's two shards."""
    sb = _sync_bytes()
    cl = sb.Cluster()
    stages = [sb.StageBytes(60, 4, 1000)]
    lay = sb.Layout(world=4, gpus_per_node=2, ep=4, engines=1, engine_tp=4)
    one = sb.owner_direct_built_load(stages, lay, cl, engine_ep=1, num_experts=4)
    two = sb.owner_direct_built_load(stages, lay, cl, engine_ep=2, num_experts=4)
    assert sb.node_egress(one) == pytest.approx({0: 500 + 64, 1: 500})
    assert sb.node_egress(two) == pytest.approx({0: 64})
    # engine_ep 1: slices of 1/4 (62.5 B); node 1 ([2, 3]) receives expert 0 on rank 2 and expert 1 on
    # rank 3 (250 B + the dense ring's 32 B each); rank 3 reads shards 2 (owner) and 0 from rank 2
    assert one.bytes[(2, "ib", "in")] == pytest.approx(250 + 32) and one.bytes[(3, "ib", "in")] == 250 + 32
    assert one.bytes[(3, "nvlink", "in")] == pytest.approx(64 + 2 * 62.5)
    # engine_ep 2: slices of 1/2 (125 B) of the node's own two shards
    assert _links(two) == pytest.approx(
        _plus(
            _dense_ring_from_0(),
            {
                (0, "nvlink", "out"): 125,
                (1, "nvlink", "in"): 125,
                (1, "nvlink", "out"): 125,
                (0, "nvlink", "in"): 125,
                (2, "nvlink", "out"): 125,
                (3, "nvlink", "in"): 125,
                (3, "nvlink", "out"): 125,
                (2, "nvlink", "in"): 125,
            },
        )
    )
    # on one node, with no expert-DP copy to choose from, built and designed move the same bytes
    single = sb.Layout(world=2, gpus_per_node=2, ep=2, engines=1, engine_tp=2)
    designed = sb.owner_direct_load(stages, single, "colocated", cl)
    assert _links(sb.owner_direct_built_load(stages, single, cl)) == pytest.approx(_links(designed))


@pytest.mark.parametrize("engine_ep", [1, 2, 4])
@pytest.mark.parametrize("ep", [2, 4])
def test_built_routes_equal_owner_direct_routing(engine_ep, ep):
    """``built_expert_routes`` (the model) gives each routed expert the holders and slots that
    ``OwnerDirectRouting.holders`` (the code) gives it: pp2, 8 experts, 2 engines of TP4 on 4 nodes x
    2 GPUs; ep2 has an expert-DP replica per shard on the stage's other node (the item's ``copies``,
    checked against ``build_export_plan`` in test_owner_and_source_bytes_equal_the_export_plan), ep4 none.
    Each stage's experts are loaded on the other stage's nodes too, which hold no copy: there the holder
    of expert x is ranks[x % len(ranks)] of the node's needing ranks (two per node with engine_ep 1 or 2,
    one with engine_ep 4), so a rule that ignored the expert index would fail here. Each such holder's
    sender is the model's ``BuiltRoute.sender`` (of the holder's node); the code's rule
    (``weight_sync.buckets._routed``, private and collective, so restated here for the comparison only):
    senders = (item.owner, *item.copies), over the item's fields, whose order
    test_owner_and_source_bytes_equal_the_export_plan checks against ``build_export_plan``; the i-th
    holder not among them (ascending) takes senders[i % count]. With ep2 that differs from
    senders[holder % count] (engine_ep 1: both stage-0 receivers of an expert, 4 + x % 2 and 6 + x % 2,
    share a residue), and with engine_ep 1 some receivers take an expert from its replica."""
    from gspo_megatron.weight_sync.owner_direct import OwnerDirectRouting

    sb = _sync_bytes()
    experts = 8
    lay = sb.Layout(world=8, gpus_per_node=2, pp=2, ep=ep, engines=2, engine_tp=4, engine_ep=engine_ep)
    specs = [SimpleNamespace(index=e, train_ranks=tuple(range(4 * e, 4 * e + 4))) for e in range(2)]
    routing = OwnerDirectRouting(specs, [r // 2 for r in range(8)], engine_ep, experts)
    routes = sb.built_expert_routes(lay, num_experts=experts)
    assert sum(r.fraction for r in routes if r.stage == 0) == 1  # every expert once per stage
    assert {len(r.copies) for r in routes} == {4 // ep}
    spread = set()  # holders on a node without a copy that are not its lowest needing rank
    from_replica = set()  # senders that are not the owner
    by_rank = set()  # (stage, expert) whose senders by holder rank would differ
    for s in range(2):
        for x in range(experts):
            k, j = x // (experts // ep), x // (experts // engine_ep)
            (route,) = [r for r in routes if (r.stage, r.shard, r.ep_rank) == (s, k, j)]
            assert x in route.experts and route.fraction == Fraction(len(route.experts), experts)
            item = SimpleNamespace(
                stack=None,
                hf_names=[f"model.layers.{s}.mlp.experts.{x}.down_proj.weight"],
                global_name=f"decoder.layers.{s}.mlp.experts.local_experts.{x}.linear_fc2.weight",
                owner=route.owner,
                copies=route.copies[1:],
            )
            held = route.holders_of(x)
            want = {h: tuple(sorted(routing.slot_of[r] for r in rs)) for h, rs in held.items()}
            got = {h: tuple(sorted(slots)) for h, slots in routing.holders(item, local=False).items()}
            assert got == want, (s, x)
            spread |= {h for h, rs in held.items() if h not in route.copies and h != rs[0]}
            senders = (item.owner, *item.copies)  # ``_routed``'s rule, from the item's fields
            receivers = [h for h in sorted(got) if h not in senders]
            for i, h in enumerate(receivers):
                assert route.sender(lay.node(h)) == senders[i % len(senders)], (s, x, h)
                from_replica |= {route.sender(lay.node(h))} - {item.owner}
                by_rank |= {(s, x)} if senders[h % len(senders)] != senders[i % len(senders)] else set()
    assert bool(spread) == (engine_ep < 4)
    assert bool(by_rank) == (ep == 2)  # the old rule, senders[holder % count], would fail here
    assert bool(from_replica) == (ep == 2 and engine_ep == 1)  # else one node lacks each expert
