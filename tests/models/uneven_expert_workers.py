"""Rank functions for the uneven-expert-load layout tests (module level: spawned ranks import them).

``score_and_train(rank, world, hf_dir, layouts, rows, records, overrides)``: for each layout, build
the trainer's model from the HF directory (as gspo-train does), score ``rows`` through the scorer
path, then run one GSPO training step (``train_capturing``: ``train_on_batch``, old log-probs,
``gspo.mini_batches`` optimizer steps) on ``records``. While it runs, every split-size all-gather of the MoE alltoall
dispatcher over the tensor-parallel group is recorded (the sizes are the token counts each TP rank
routes to this rank's experts), so the test can assert that the loads really were uneven.
Returns, on rank 0, {layout_name: {"logprobs", "metrics", "splits"}}; the splits of all ranks are
gathered to rank 0. With ``capture_grads`` each result also holds "grads": {name: full-size gradient}
of the first optimizer step (``full_gradients``), and "grad_norms": every rank's metrics grad norm.

``score_and_train_many(rank, world, jobs, rows, records, overrides, capture_grads)``: the same for
several (key, hf_dir, layouts) jobs in one set of spawned ranks (one start-up for many models):
{key: {layout_name: result}} on rank 0.

``train_capturing(cfg, model, records, capture)``: that training step (DDP and optimizer as ``cfg``
says) with the first optimizer step's gradients at full size (``full_gradients``); the LoRA workers
(lora_workers.py, lora_te_workers.py) train through it too.
"""

from __future__ import annotations

import torch
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


def _gated_halves_in_order(parts: list, dim: int) -> list:
    """TP shards of a gated (SwiGLU) fc1 each hold [gate_r; up_r]: reorder to [gate_0..; up_0..]."""
    halves = [q.chunk(2, dim=dim) for q in parts]
    return [h[0] for h in halves] + [h[1] for h in halves]


def _gated_delta_net_parts_in_order(parts: list, config, name: str) -> list:
    """TP shards of a Gated DeltaNet ``in_proj`` hold [q_r; k_r; v_r; z_r; beta_r; alpha_r] (``conv1d``:
    [q_r; k_r; v_r]): reorder to [q_0..; k_0..; ...] (models/qwen3_next/rules.py)."""
    qk = config.linear_num_key_heads * config.linear_key_head_dim // len(parts)
    v = config.linear_num_value_heads * config.linear_value_head_dim // len(parts)
    h = config.linear_num_value_heads // len(parts)
    sizes = [qk, qk, v, v, h, h] if ".in_proj." in name else [qk, qk, v]
    split = [torch.split(q, sizes, dim=0) for q in parts]
    return [s[i] for i in range(len(sizes)) for s in split]


def full_gradients(ddp) -> dict:
    """Every rank calls it after a forward-backward (after ``finalize_model_grads``): each parameter's
    reduced gradient at the single-rank shape, on rank 0 ({} elsewhere), named as on one rank
    (routed experts by their global index). The distributed optimizer's reduce-scatter leaves only
    this rank's shard of each bucket reduced: the shards are all-gathered first. TP shards are
    gathered over the TP group (experts: the expert-TP group) along ``partition_dim``."""
    import re

    import torch
    from megatron.core import parallel_state as ps

    reduced = {}
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        data = buffer.grad_data
        group = buffer.data_parallel_group
        if ddp.ddp_config.use_distributed_optimizer and group.size() > 1:
            data = data.clone()
            for bucket in buffer.buckets:  # each bucket is reduce-scattered in equal shards
                shards = bucket.grad_data.view(group.size(), -1)
                parts = [torch.empty_like(q) for q in shards]
                dist.all_gather(parts, shards[group.rank()].contiguous(), group=group)
                data[bucket.offset : bucket.offset + bucket.grad_data.numel()] = torch.cat(parts)
        for param, (start, end, _) in buffer.param_index_map.items():
            reduced[param] = data[start:end].view(param.shape)
    config = ddp.module.config
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    out = {}
    for name, param in ddp.module.named_parameters():
        if not param.requires_grad:  # frozen (the DSA indexer): no gradient buffer
            continue
        grad = reduced[param].detach().double().clone()
        expert = not getattr(param, "allreduce", True) or ".mlp.experts." in name
        group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
        if getattr(param, "tensor_model_parallel", False) and group.size() > 1:
            parts = [torch.empty_like(grad) for _ in range(group.size())]
            dist.all_gather(parts, grad.contiguous(), group=group)
            if config.gated_linear_unit and ".linear_fc1." in name and param.partition_dim == 0:
                parts = _gated_halves_in_order(parts, 0)
            if re.search(r"\.self_attention\.(in_proj|conv1d)\.weight$", name):
                parts = _gated_delta_net_parts_in_order(parts, config, name)
            grad = torch.cat(parts, dim=param.partition_dim)
        grouped = re.search(r"\.experts\.linear_fc([12])\.(weight|lora_A|lora_B)(\d+)$", name)
        if grouped:  # Transformer Engine's grouped experts: named as the local spec's
            fc, kind, i = grouped.groups()
            name = name[: grouped.start()] + f".experts.local_experts.{i}.linear_fc{fc}.{kind}"
        if ".local_experts." in name:
            local = config.num_moe_experts // ep
            name = re.sub(
                r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * local + int(m.group(1))}.", name
            )
        out[name] = grad
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    merged = {}
    for d in everyone:
        merged.update(d)
    return merged if dist.get_rank() == 0 else {}


def train_capturing(cfg, model, records: list, capture: bool = True) -> tuple:
    """One GSPO training step of ``model`` (DDP and optimizer as ``cfg`` says): (optimizer, metrics,
    the first optimizer step's reduced gradients at full size, ``full_gradients``; {} unless ``capture``)."""
    from gspo_megatron.trainer import step as train_step
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training

    o, p = cfg.optimizer, cfg.parallel
    ddp, optimizer, scheduler = setup_training(
        model,
        OptimOptions(
            lr=o.lr,
            clip_grad=o.clip_grad,
            total_steps=cfg.gspo.mini_batches,
            use_distributed_optimizer=p.use_distributed_optimizer,
        ),
    )
    grads: dict = {}
    step = train_step.optimizer_step

    def capturing_step(*args, **kwargs):
        if capture and "done" not in grads:
            grads.update(full_gradients(ddp), done=True)
        return step(*args, **kwargs)

    train_step.optimizer_step = capturing_step
    try:
        metrics = train_step.train_on_batch(cfg, ddp, optimizer, scheduler, records, pad_id=0).metrics
    finally:
        train_step.optimizer_step = step
    grads.pop("done", None)
    return optimizer, metrics, grads


def score_and_train_many(
    rank: int,
    world: int,
    jobs: list[tuple],
    rows: list[list[int]],
    records: list,
    overrides: list[str],
    capture_grads: bool = False,
) -> dict:
    out = {
        key: score_and_train(rank, world, hf_dir, layouts, rows, records, overrides, capture_grads, destroy=False)
        for key, hf_dir, layouts in jobs
    }
    from gspo_megatron.runtime.distributed import destroy_distributed

    destroy_distributed()
    return out


def score_and_train(
    rank: int,
    world: int,
    hf_dir: str,
    layouts: list[dict],
    rows: list[list[int]],
    records: list,
    overrides: list[str],
    capture_grads: bool = False,
    destroy: bool = True,
) -> dict:
    from gspo_megatron import factory
    from gspo_megatron.config import load_config
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.score import score_rows

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
            _, metrics, grads = train_capturing(cfg, model, records, capture=capture_grads)
        finally:
            restore()
        everyone = [None] * world
        dist.all_gather_object(everyone, splits)
        norms = [None] * world
        dist.all_gather_object(norms, metrics["train/grad_norm"])
        if rank == 0:
            results[layout_name(layout)] = {
                "logprobs": lps,
                "metrics": metrics,
                "splits": everyone,
                "grad_norms": norms,
            }
            if capture_grads:
                results[layout_name(layout)]["grads"] = grads
    if destroy:
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
