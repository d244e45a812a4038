"""Rank functions for the uneven-expert-load layout tests (module level: spawned ranks import them).

``score_and_train(rank, world, hf_dir, layouts, rows, records, overrides)``: for each layout, build
the trainer's model from the HF directory (as gspo-train does), score ``rows`` through the scorer
path, then run one GSPO training step (``train_on_batch``: old log-probs, ``gspo.mini_batches``
optimizer steps) on ``records``. While it runs, every split-size all-gather of the MoE alltoall
dispatcher over the tensor-parallel group is recorded (the sizes are the token counts each TP rank
routes to this rank's experts), so the test can assert that the loads really were uneven.
Returns, on rank 0, {layout_name: {"logprobs", "metrics", "splits"}}; the splits of all ranks are
gathered to rank 0.
"""

from __future__ import annotations

import torch.distributed as dist

from conversion_workers import layout_name


def _record_dispatcher_splits(log: list):
    """Wrap the dispatcher's gather_from_sequence_parallel_region to log its output_split_sizes."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.gather_from_sequence_parallel_region

    def gather(input_, *args, output_split_sizes=None, **kwargs):
        if output_split_sizes is not None:
            log.append(list(output_split_sizes))
        return original(input_, *args, output_split_sizes=output_split_sizes, **kwargs)

    token_dispatcher.gather_from_sequence_parallel_region = gather
    return lambda: setattr(token_dispatcher, "gather_from_sequence_parallel_region", original)


def score_and_train(rank: int, world: int, hf_dir: str, layouts: list[dict], rows: list[list[int]],
                    records: list, overrides: list[str]) -> dict:
    from gspo_megatron import factory
    from gspo_megatron.config import load_config
    from gspo_megatron.models.build import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.optim import OptimOptions, setup_training
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.score import score_rows
    from gspo_megatron.train_step import train_on_batch

    hf = load_hf_config(hf_dir)
    results = {}
    for layout in layouts:
        cfg = load_config(None, [*overrides, *(f"parallel.{k}={v}" for k, v in layout.items())])
        p = cfg.parallel
        init_distributed(ParallelLayout(p.tp, p.pp, p.ep, p.etp, p.cp, bool(p.sequence_parallel)), seed=cfg.seed)
        splits: list = []
        restore = _record_dispatcher_splits(splits)
        try:
            model = factory.build_model(cfg, hf)
            load_hf_weights(model, hf_dir)
            lps = score_rows(model, rows, micro_batch_size=3)
            o = cfg.optimizer
            ddp, optimizer, scheduler = setup_training(model, OptimOptions(
                lr=o.lr, clip_grad=o.clip_grad, total_steps=cfg.gspo.mini_batches,
                use_distributed_optimizer=p.use_distributed_optimizer))
            metrics = train_on_batch(cfg, ddp, optimizer, scheduler, records, pad_id=0).metrics
        finally:
            restore()
        everyone = [None] * world
        dist.all_gather_object(everyone, splits)
        if rank == 0:
            results[layout_name(layout)] = {"logprobs": lps, "metrics": metrics, "splits": everyone}
    destroy_distributed()
    return results if rank == 0 else {}


def uneven_collectives(rank: int, world: int, sizes: list[int]) -> dict:
    """Megatron's split-size gather / reduce-scatter over a gloo group of ``world`` ranks (through
    the CPU layer), forward and backward. Rank r holds ``sizes[r]`` rows of r-dependent values.
    Returns rank's gathered rows, its input gradient, and its reduce-scatter output."""
    import torch
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    from gspo_megatron.runtime.cpu_compat import activate

    activate()
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world)))
    x = (torch.arange(sizes[rank] * 3, dtype=torch.float64).reshape(-1, 3) + 100 * rank).requires_grad_(True)
    gathered = gather_from_sequence_parallel_region(x, group=group, output_split_sizes=sizes)
    weight = torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape) * (rank + 1)
    (gathered * weight).sum().backward()  # d/dx = sum over ranks k of weight_k rows of this rank
    full = (torch.arange(sum(sizes) * 3, dtype=torch.float64).reshape(-1, 3) + 7) * (rank + 1)
    scattered = reduce_scatter_to_sequence_parallel_region(full, group=group, input_split_sizes=sizes)
    return {"gathered": gathered.detach(), "grad": x.grad, "scattered": scattered}
