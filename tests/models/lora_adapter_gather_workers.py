"""Rank function for test_lora_adapter_gather.py (module level: spawned ranks import it).

``gathered_adapters(rank, world, hf_dir, layouts, overrides)``: per layout, the LoRA model (B set to
the same random values in every layout, ``lora_workers.set_random_b``), then the adapter sync's
``gathered_peft_tensors`` (the (E)TP gathers, the plan's owners, the gather to rank 0). Returns
{layout_name: {PEFT name: tensor}} on rank 0. ``impl="transformer_engine"``: the TE layer spec through
the TE stand-in (grouped experts: one adapter per expert)."""

from __future__ import annotations

from distributed_harness import fresh_process


@fresh_process  # the TE stand-in is installed before megatron is imported
def gathered_adapters(
    rank: int, world: int, hf_dir: str, layouts: list[dict], overrides: list[str], impl: str = "auto"
) -> dict:
    import torch

    if impl == "transformer_engine":  # Transformer Engine's layer spec through the stand-in
        import te_standin

        te_standin.install()
        te_standin.patch_build()

    from conversion_workers import layout_name
    from gspo_megatron import factory
    from gspo_megatron.config import load_config
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import build_export_plan
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.weight_sync.lora_adapter import gathered_peft_tensors
    from lora_workers import set_random_b

    out: dict = {}
    hf = load_hf_config(hf_dir)
    for layout in layouts:
        lay = [f"parallel.{k}={v}" for k, v in layout.items()]
        cfg = load_config(None, [*overrides, f"model.transformer_impl={impl}", *lay])
        p = cfg.parallel
        init_distributed(ParallelLayout(p.tp, p.pp, p.ep, p.etp, p.cp, bool(p.sequence_parallel)), seed=cfg.seed)
        model = factory.build_model(cfg, hf)
        set_random_b(model)
        tensors, modules = gathered_peft_tensors(model, build_export_plan(model))
        if world == 1:  # the PEFT export's names and values
            from gspo_megatron.models.lora_peft import peft_tensors

            want, want_modules = peft_tensors(model, experts=True)
            assert sorted(want_modules) == sorted(modules) and sorted(want) == sorted(tensors)
            assert all(torch.equal(want[k].cpu(), tensors[k]) for k in want)
        if rank == 0:
            out[layout_name(layout)] = dict(tensors=tensors, modules=sorted(modules))
        del model
    destroy_distributed()
    return out if rank == 0 else {}
