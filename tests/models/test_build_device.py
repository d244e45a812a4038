"""build_model leaves every parameter on the rank's compute device, as Megatron's own ``get_model``
does: on the local spec (Megatron's ``WrappedTorchNorm`` is ``torch.nn.RMSNorm`` built without a
device) the norms started on the CPU of a GPU rank, and a model used outside Megatron's DDP (the KL
reference model, conversion) then mixed devices. Seen on an H200 (docs/gpu.md). On CPU the device is
stood in for by ``meta``: a parameter left where it was built is still on the CPU."""

from __future__ import annotations

from distributed_harness import run_ranks
from tiny_models import tiny_hf_config


def _devices_worker(rank, world, family):
    import torch

    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.runtime import distributed as rdist
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    init_distributed(ParallelLayout())
    rdist.device = lambda: torch.device("meta")  # this spawned rank's "GPU"
    hf = tiny_hf_config(family)
    model = build_model(hf, opts=ModelOptions(transformer_impl="local"))
    return sorted({f"{p.device.type}" for p in model.parameters()} | {b.device.type for b in model.buffers()})


def test_local_spec_models_end_on_the_compute_device():
    for family in ("qwen3_moe", "deepseek_v3"):
        (devices,) = run_ranks(_devices_worker, 1, family)
        assert devices == ["meta"], (family, devices)
