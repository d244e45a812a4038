"""The engine-independent sync plan on gloo: tensors gathered from TP2, EP2 and PP2 layouts (and
TP2 x EP2) and cut into buckets equal the HF checkpoint tensor for tensor; buckets respect the limit.
The three routings of weight_sync.topology: to rank 0 (in-process engine), to every rank (colocated
engines) and per pipeline stage (disaggregated: each stage's source gets exactly its stage's tensors)."""

import pytest
import torch

from distributed_harness import run_ranks

BUCKET = 40_000  # bytes: several buckets for the tiny model; some tensors exceed it alone


class Recorder:
    """A transport that records what it is sent (rank 0)."""

    def __init__(self):
        self.calls = []
        self.buckets = []

    def begin(self, version):
        self.calls.append(f"begin {version}")

    def send_bucket(self, bucket):
        self.buckets.append([(n, t.clone()) for n, t in bucket])

    def end(self):
        self.calls.append("end")


def _worker(rank, world, hf_dir, cases):
    """Runs every (layout, routing) of ``cases`` in turn on these ranks (the layout re-initialized for
    each, a fresh model built and loaded); returns one result per case, as ``_sync_once``."""
    return [_sync_once(rank, hf_dir, layout, routing) for layout, routing in cases]


def _sync_once(rank, hf_dir, layout, routing):
    from gspo_megatron.models.build import build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import ALL_RANKS, load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.weight_sync.sync import WeightSyncer
    from gspo_megatron.weight_sync.topology import SyncTopology, stage_sources

    init_distributed(ParallelLayout(**layout))
    model = build_model(
        load_hf_config(hf_dir), layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1), layout.get("etp")
    )
    load_hf_weights(model, hf_dir)
    if routing == "rank0":
        topology = SyncTopology("inprocess", 0, Recorder() if rank == 0 else None)
    elif routing == "all":
        topology = SyncTopology("colocated", ALL_RANKS, Recorder())
    else:
        stage_of, sources = stage_sources()
        topology = SyncTopology(
            "disaggregated",
            lambda owner: sources[stage_of[owner]],
            Recorder() if rank in sources else None,
            sources=sources,
        )
    syncer = WeightSyncer(model, topology, bucket_mb=BUCKET / (1 << 20))
    metrics = syncer.sync()
    rec = topology.transport
    from megatron.core import parallel_state as ps

    stage = ps.get_pipeline_model_parallel_rank()
    return (rec.calls, rec.buckets, metrics, stage) if rec is not None else None


# (layout, world size, routing) of every test below. The cases of one world size share one spawned
# job (starting the ranks costs more than a tiny model's sync); each case still builds its own model.
CASES = [
    ({"tp": 2}, 2, "rank0"),
    ({"ep": 2}, 2, "rank0"),
    ({"pp": 2}, 2, "rank0"),
    ({"tp": 2, "ep": 2, "etp": 1}, 4, "rank0"),
    ({"tp": 2}, 2, "all"),
    ({"pp": 2}, 2, "stages"),
    ({"pp": 2, "ep": 2}, 4, "stages"),
]


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    """{(layout name, routing): per-rank results} for every case, and the HF checkpoint's tensors."""
    from safetensors.torch import load_file

    from gspo_megatron.models.tiny import save_tiny_hf_model

    hf_dir = tmp_path_factory.mktemp("sync_plan")
    save_tiny_hf_model("qwen3_moe", str(hf_dir))
    reference = load_file(str(hf_dir / "model.safetensors"))
    results = {}
    for world in sorted({w for _, w, _ in CASES}):
        cases = [(layout, routing) for layout, w, routing in CASES if w == world]
        per_rank = run_ranks(_worker, world, str(hf_dir), cases)
        for i, (layout, routing) in enumerate(cases):
            results[(_name(layout), routing)] = [r[i] for r in per_rank]
    return results, reference


def _name(layout: dict) -> str:
    return "".join(f"{k}{v}" for k, v in layout.items() if k != "etp")


@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2", "tp2ep2"])
def test_sync_buckets_equal_the_hf_checkpoint(synced, layout):
    results, reference = synced
    calls, buckets, metrics, _ = results[(layout, "rank0")][0]
    assert calls == ["begin 1", "end"]
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(reference) and len(names) == len(set(names))
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1, (size, [n for n, _ in bucket])
        for name, t in bucket:
            assert t.dtype == reference[name].dtype and torch.equal(t, reference[name]), name
    assert metrics["sync/buckets"] == len(buckets) > 3
    assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for t in reference.values())


def _check_buckets(buckets, reference):
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1, (size, [n for n, _ in bucket])
        for name, t in bucket:
            assert t.dtype == reference[name].dtype and torch.equal(t, reference[name]), name


def test_colocated_routing_gives_every_rank_every_tensor(synced):
    """Colocated engines: each training rank hands the engine TP rank on its GPU the full bucket."""
    all_results, reference = synced
    results = all_results[("tp2", "all")]
    assert len(results) == 2
    for calls, buckets, metrics, _ in results:
        assert calls == ["begin 1", "end"]
        assert sorted(n for b in buckets for n, _ in b) == sorted(reference)
        _check_buckets(buckets, reference)


@pytest.mark.parametrize("layout", ["pp2", "pp2ep2"])
def test_stage_routing_sends_each_stage_from_its_own_source(synced, layout):
    """Disaggregated: every tensor reaches exactly one source, the source of the stage that owns it;
    the busiest source moves about its stage's share of the model, not the whole model."""
    all_results, reference = synced
    results = [r for r in all_results[(layout, "stages")] if r is not None]
    assert [r[3] for r in results] == [0, 1]  # one source per stage, in stage order
    seen = {}
    for calls, buckets, metrics, stage in results:
        assert calls == ["begin 1", "end"] and buckets
        _check_buckets(buckets, reference)
        for b in buckets:
            for n, _ in b:
                assert n not in seen, f"{n} sent by two sources"
                seen[n] = stage
    assert sorted(seen) == sorted(reference)
    layers = {n: int(n.split(".")[2]) for n in seen if n.startswith("model.layers.")}
    per_stage = (max(layers.values()) + 1) // 2  # PP2 splits the layers evenly
    assert all(seen[n] == layer // per_stage for n, layer in layers.items())
    assert seen["model.embed_tokens.weight"] == 0 and seen["lm_head.weight"] == 1
    total = sum(t.numel() * t.element_size() for t in reference.values())
    per_source = [r[2]["sync/bytes"] for r in results]
    assert sum(per_source) == total and max(per_source) < total
    assert all(r[2]["sync/bytes_max_rank"] == max(per_source) for r in results)
