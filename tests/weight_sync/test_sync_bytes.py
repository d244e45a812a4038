"""bench/sync_bytes.py's byte model against the real export plan: on gloo worlds (pp2, pp2 x ep2)
with a tiny Qwen3-MoE, the bytes each rank owns in ``build_export_plan`` and the bytes each stage
source receives under the disaggregated routing (``topology.stage_sources``) equal the model's
formula (planner parameter counts, Megatron's rank order); plus the ring accounting by hand."""

import importlib.util
import os
import sys

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
    return owned, to_source, {it.dtype.itemsize for it in items}


@pytest.mark.parametrize("layout,world", [({"pp": 2}, 2), ({"pp": 2, "ep": 2}, 4)], ids=["pp2", "pp2ep2"])
def test_owner_and_source_bytes_equal_the_export_plan(tmp_path, layout, world):
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from gspo_megatron.planner import ModelDims

    sb = _sync_bytes()
    save_tiny_hf_model("qwen3_moe", str(tmp_path))
    owned, to_source, itemsizes = run_ranks(_plan_worker, world, str(tmp_path), layout)[0]
    assert len(itemsizes) == 1
    hf = load_hf_config(str(tmp_path))
    # transformers 5 writes num_local_experts; the planner reads num_experts (as the published configs have)
    hf.setdefault("num_experts", hf.get("num_local_experts"))
    dims = ModelDims.from_hf_config(hf)
    lay = sb.Layout(world=world, gpus_per_node=2, pp=layout["pp"], ep=layout.get("ep", 1))
    stages = sb.stage_bytes(dims, lay.pp, itemsizes.pop())
    assert sb.owner_bytes(stages, lay) == owned
    assert sb.source_bytes(stages, lay) == to_source
    assert len(to_source) == 2 and min(to_source.values()) > 0


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
    rows = [line for line in out.splitlines() if line.strip().startswith("qwen3_30b_a3b_gspo ")]
    modes = [line[36:].split()[0] + " " + line[50:72].strip() for line in rows]
    assert modes == [
        "colocated full (built)",
        "colocated owner-direct",
        "colocated delta 1.79% (built)",
        "colocated delta 1.79% owner",
        "colocated delta 0.05% (built)",
        "colocated delta 0.05% owner",
        "disaggregated full (built)",
        "disaggregated owner-direct",
        "disaggregated delta 1.79% (built)",
        "disaggregated delta 1.79% owner",
        "disaggregated delta 0.05% (built)",
        "disaggregated delta 0.05% owner",
    ]
