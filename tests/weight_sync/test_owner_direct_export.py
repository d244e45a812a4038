"""The export stream under an owner-direct routing (``weight_sync.buckets._routed``), on 4 gloo ranks that
the routing places on 4 nodes: the training layout is EP2 with expert-DP 2 (ranks 0 / 1 own the two
expert halves, ranks 2 / 3 hold replicas), two engines of TP 2 load every expert. Each node lacks
one half and receives it; of the two nodes that lack a half, one gets it from the owner and the
other from the replica. Every tensor a rank receives must equal the checkpoint bitwise, and each
rank must get exactly the shared tensors and the experts it holds (here all of them)."""

from __future__ import annotations

import torch

from distributed_harness import run_ranks

BUCKET = 40_000
NODES = [0, 1, 2, 3]


class _Recorder:
    def __init__(self):
        self.buckets = []

    def begin(self, version):
        pass

    def send_bucket(self, bucket):
        self.buckets.append([(n, t.clone()) for n, t in bucket])

    def end(self):
        pass


def _worker(rank, world, hf_dir):
    from types import SimpleNamespace

    from gspo_megatron.models.build import build_model
    from gspo_megatron.models.hf_config import load_hf_config, num_experts
    from gspo_megatron.models.weights import ALL_RANKS, load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.weight_sync.owner_direct import OwnerDirectRouting
    from gspo_megatron.weight_sync.sync import WeightSyncer
    from gspo_megatron.weight_sync.topology import SyncTopology

    init_distributed(ParallelLayout(ep=2))
    hf = load_hf_config(hf_dir)
    model = build_model(hf, 1, 1, 2)
    load_hf_weights(model, hf_dir)
    specs = [SimpleNamespace(index=e, train_ranks=(2 * e, 2 * e + 1)) for e in range(2)]
    routing = OwnerDirectRouting(specs, NODES, engine_ep=1, num_experts=num_experts(hf))
    topology = SyncTopology("colocated", ALL_RANKS, _Recorder(), routing=routing)
    syncer = WeightSyncer(model, topology, bucket_mb=BUCKET / (1 << 20))
    syncer.sync()
    held, from_replica = {}, 0
    for it in syncer.plan[0]:
        holders = routing.holders(it, local=False)
        if holders is None:
            continue
        senders = (it.owner, *it.copies)
        held.update({(r, n): True for r in holders for n in it.hf_names})
        receivers = [h for h in sorted(holders) if h not in senders]
        from_replica += sum(1 for i, _ in enumerate(receivers) if senders[i % len(senders)] != it.owner)
    mine = {n for (r, n) in held if r == rank}
    return syncer.topology.transport.buckets, mine, {n for (_, n) in held}, from_replica


def test_routed_export_delivers_each_holder_its_tensors_bitwise(tmp_path):
    from safetensors.torch import load_file

    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model("qwen3_moe", str(tmp_path))
    reference = load_file(str(tmp_path / "model.safetensors"))
    results = run_ranks(_worker, 4, str(tmp_path))
    routed = results[0][2]
    assert routed and results[0][3] > 0  # some copies go out from a replica, not the owner
    dense = set(reference) - routed
    for rank, (buckets, mine, _, _) in enumerate(results):
        names = [n for b in buckets for n, _ in b]
        assert len(names) == len(set(names))
        assert set(names) == dense | mine, (rank, sorted(set(names) ^ (dense | mine))[:5])
        for bucket in buckets:
            for name, t in bucket:
                assert t.dtype == reference[name].dtype and torch.equal(t, reference[name]), (rank, name)
    assert all(r[1] == routed for r in results)  # one rank per node: each holds every expert
