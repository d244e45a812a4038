"""The engine-independent sync plan on gloo: tensors gathered from TP2, EP2 and PP2 layouts (and
TP2 x EP2) and cut into buckets equal the HF checkpoint tensor for tensor; buckets respect the limit."""

import pytest
import torch

from distributed_harness import run_ranks

BUCKET = 40_000  # bytes: several buckets for the tiny model; some tensors exceed it alone


class Recorder:
    """A transport that records what it is sent (rank 0)."""

    def __init__(self):
        self.calls = []
        self.buckets = []

    def begin(self):
        self.calls.append("begin")

    def send_bucket(self, bucket):
        self.buckets.append([(n, t.clone()) for n, t in bucket])

    def end(self):
        self.calls.append("end")


def _worker(rank, world, hf_dir, layout):
    from gspo_megatron.models.build import build_model, load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.weight_sync.sync import WeightSyncer

    init_distributed(ParallelLayout(**layout))
    model = build_model(load_hf_config(hf_dir), layout.get("tp", 1), layout.get("pp", 1),
                        layout.get("ep", 1), layout.get("etp"))
    load_hf_weights(model, hf_dir)
    rec = Recorder() if rank == 0 else None
    metrics = WeightSyncer(model, bucket_mb=BUCKET / (1 << 20)).sync(rec)
    return (rec.calls, rec.buckets, metrics) if rank == 0 else None


@pytest.mark.parametrize("layout,world", [({"tp": 2}, 2), ({"ep": 2}, 2), ({"pp": 2}, 2),
                                          ({"tp": 2, "ep": 2, "etp": 1}, 4)],
                         ids=["tp2", "ep2", "pp2", "tp2ep2"])
def test_sync_buckets_equal_the_hf_checkpoint(tmp_path, layout, world):
    from safetensors.torch import load_file

    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model("qwen3_moe", str(tmp_path))
    reference = load_file(str(tmp_path / "model.safetensors"))
    calls, buckets, metrics = run_ranks(_worker, world, str(tmp_path), layout)[0]
    assert calls == ["begin", "end"]
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(reference) and len(names) == len(set(names))
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1, (size, [n for n, _ in bucket])
        for name, t in bucket:
            assert t.dtype == reference[name].dtype and torch.equal(t, reference[name]), name
    assert metrics["sync/buckets"] == len(buckets) > 3
    assert metrics["sync/bytes"] == sum(t.numel() * t.element_size() for t in reference.values())
