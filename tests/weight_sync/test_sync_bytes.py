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
    from gspo_megatron.models.build import build_model, load_hf_config
    from gspo_megatron.models.weights import build_export_plan
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.weight_sync.topology import stage_sources

    init_distributed(ParallelLayout(**layout))
    model = build_model(load_hf_config(hf_dir), layout.get("tp", 1), layout.get("pp", 1),
                        layout.get("ep", 1), layout.get("etp"))
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
    from gspo_megatron.models.build import load_hf_config
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
