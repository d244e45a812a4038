"""Rank function for the LoRA checkpoint test (module level: spawned ranks import it)."""

from __future__ import annotations

import os
import sys
import warnings
import zlib

import torch

from checkpoint_workers import _weights
from distributed_harness import fresh_process


def _setup(hf_dir: str, layout: dict, impl: str = "auto"):
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.lora import LoraOptions
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training

    init_distributed(ParallelLayout(**layout), seed=5)
    opts = ModelOptions(transformer_impl=impl, lora=LoraOptions(rank=4, alpha=8, seed=3))
    model = build_model(load_hf_config(hf_dir), opts=opts, **layout)
    load_hf_weights(model, hf_dir)
    ddp, opt, sched = setup_training(model, OptimOptions(lr=1e-2, total_steps=10))
    return model, ddp, opt, sched


def _fake_step(ddp, opt, sched, seed: int) -> None:
    """One optimizer step with deterministic pseudo-gradients on the adapters (the only trained params)."""
    from gspo_megatron.trainer.optimizer import optimizer_step, zero_grads

    zero_grads(ddp, opt)
    g = torch.Generator().manual_seed(seed)
    for p in ddp.parameters():
        if p.requires_grad:
            p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=g) * 0.1)
    applied, _ = optimizer_step(opt, sched)
    assert applied


def _adapters(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@fresh_process  # the TE stand-in is installed before megatron is imported
def lora_resume_job(
    rank: int, world: int, hf_dir: str, root: str, layout: dict, other_layout: dict, impl: str = "auto"
) -> dict:
    """Train the adapters, checkpoint, continue; resume in a fresh model and continue the same way
    (bitwise); only adapters trained and in the optimizer; the checkpoint read into another layout and
    exported to HF (merged). ``impl``: the layer spec of every model here (``transformer_engine``: through
    the TE stand-in, where ``auto`` is TE too, so the export's model is)."""
    if impl == "transformer_engine":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))
        import te_standin

        te_standin.install()
        te_standin.patch_build()
    from gspo_megatron.checkpoint import manager as ck
    from gspo_megatron.runtime.distributed import destroy_distributed

    res = {}
    model, ddp, opt, sched = _setup(hf_dir, layout, impl)
    res["optimizer_params"] = sum(p.numel() for g in opt.param_groups for p in g["params"])
    res["adapter_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    _fake_step(ddp, opt, sched, seed=1)
    res["base_unchanged"] = all(
        torch.equal(p, base_before[n]) for n, p in model.named_parameters() if not p.requires_grad
    )
    ck.save_checkpoint(root, 1, ddp, opt, sched, extra_state={"data_position": 3}, keep_last=2)
    weights_at_1 = _weights(model)
    _fake_step(ddp, opt, sched, seed=2)
    expected, expected_adapters = _weights(model), _adapters(model)

    model2, ddp2, opt2, sched2 = _setup(hf_dir, layout, impl)
    res["resumed"] = ck.load_checkpoint(root, ddp2, opt2, sched2)
    _fake_step(ddp2, opt2, sched2, seed=2)  # Adam's moments restored: the same update as uninterrupted
    got = _weights(model2)
    res["adapters_differing"] = [n for n, p in _adapters(model2).items() if not torch.equal(p, expected_adapters[n])]
    if rank == 0:
        res["weights_equal"] = sorted(got) == sorted(expected) and all(
            torch.equal(got[k], expected[k]) for k in expected
        )
        res["merged_moved"] = any(not torch.equal(weights_at_1[k], expected[k]) for k in expected)

    model3 = _setup(hf_dir, other_layout, impl)[0]
    ck.load_checkpoint(os.path.join(root, "step_000001"), model3)
    w3 = _weights(model3)
    if rank == 0:
        res["other_layout_equal"] = all(torch.allclose(w3[k], weights_at_1[k], rtol=0, atol=1e-6) for k in weights_at_1)
    from gspo_megatron.convert import megatron_to_hf

    out = root + "-exported"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        files = megatron_to_hf(os.path.join(root, "step_000001"), out, **other_layout)
    if rank == 0:
        from safetensors.torch import load_file

        exported = load_file(os.path.join(out, files[0]))
        res["export_equal"] = sorted(exported) == sorted(weights_at_1) and all(
            torch.allclose(exported[k], weights_at_1[k], rtol=0, atol=1e-6) for k in weights_at_1
        )
    destroy_distributed()
    return res


def lora_adapter_checkpoint_job(rank: int, world: int, hf_dir: str, out: str, targets: list | None) -> dict:
    """Write a LoRA checkpoint (tp = world) of the HF model at ``hf_dir`` with trained-looking adapters
    (B random, not zero) on ``targets`` (None: the default targets) at ``out`` (for the PEFT export)."""
    from gspo_megatron.checkpoint.manager import write_checkpoint_dir
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.lora import DEFAULT_TARGETS, LoraOptions, lora_modules
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(tp=world), seed=5)
    opts = LoraOptions(rank=4, alpha=8, seed=3, target_modules=list(targets or DEFAULT_TARGETS))
    model = build_model(load_hf_config(hf_dir), tp=world, opts=ModelOptions(lora=opts))
    load_hf_weights(model, hf_dir)
    with torch.no_grad():
        for _, m in lora_modules(model):
            g = torch.Generator().manual_seed(zlib.crc32(m.lora_global_name.encode()))  # replicas agree
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.05)
    write_checkpoint_dir(out, 1, model, hf_assets_dir=hf_dir, save_rng=False)
    destroy_distributed()
    return {}
