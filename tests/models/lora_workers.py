"""Rank functions for the LoRA tests (module level: spawned ranks import them).

``lora_layouts(rank, world, jobs, rows, records, overrides)``: for each (kind, hf_dir, layouts) and each
layout: the base model's log-probs and the LoRA model's (fresh adapters, B = 0); then B set to the
same random values in every layout (``set_random_b``), one GSPO training step (old log-probs,
``gspo.mini_batches`` optimizer steps) with the first step's reduced gradients captured at full
size; then the trained model's log-probs through the adapters and after ``merge_into_base``.
Returns {kind: {layout_name: result}} on rank 0.

``finite_differences(rank, world, hf_dir, overrides)``: one rank, the LoRA model in float64, a
weighted sum of log-probs: autograd's dL/dA, dL/dB against central differences along random
directions (all adapters at once, and per module kind).
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from conversion_workers import layout_name
from uneven_expert_workers import train_capturing


def set_random_b(model, seed: int = 7, scale: float = 0.05) -> None:
    """Every LoRA B := the same full random matrix (seeded by the global name) in every layout, this
    rank's rows of it (column-parallel base: split like W's rows, gated fc1 by halves; row-parallel:
    replicated)."""
    from gspo_megatron.models.lora import lora_modules
    from gspo_megatron.models.lora_base import group_size, seed_name

    for _, m in lora_modules(model):
        r = m.lora_B.shape[1]
        g = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(seed_name(m.lora_global_name).encode()))
        full = torch.randn(m.lora_full_out, r, generator=g, dtype=torch.float64) * scale
        if m.lora_column:
            size = group_size(m.lora_tp_group)
            t = dist.get_rank(m.lora_tp_group) if size > 1 else 0
            if m.lora_gated:
                gate, up = full.chunk(2)
                full = torch.cat([gate.chunk(size)[t], up.chunk(size)[t]])
            else:
                full = full.chunk(size)[t]
        with torch.no_grad():
            m.lora_B.copy_(full.to(m.lora_B.dtype))


def lora_layouts(
    rank: int, world: int, jobs: list[tuple], rows: list[list[int]], records: list, overrides: list[str]
) -> dict:
    from gspo_megatron import factory
    from gspo_megatron.config import load_config
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.lora import merge_into_base
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.score import score_rows

    out: dict = {}
    for kind, hf_dir, layouts in jobs:
        hf = load_hf_config(hf_dir)
        for layout in layouts:
            cfg = load_config(None, [*overrides, *(f"parallel.{k}={v}" for k, v in layout.items())])
            p = cfg.parallel
            init_distributed(ParallelLayout(p.tp, p.pp, p.ep, p.etp, p.cp, bool(p.sequence_parallel)), seed=cfg.seed)
            base_cfg = load_config(
                None, [*overrides, "model.lora.rank=0", *(f"parallel.{k}={v}" for k, v in layout.items())]
            )
            base = factory.build_model(base_cfg, hf)
            load_hf_weights(base, hf_dir)
            base_lps = score_rows(base, rows, micro_batch_size=3)
            del base
            model = factory.build_model(cfg, hf)
            load_hf_weights(model, hf_dir)
            fresh_lps = score_rows(model, rows, micro_batch_size=3)
            trainable = sorted(n for n, q in model.named_parameters() if q.requires_grad)
            set_random_b(model)
            # full_gradients names layers by their stage-local index: pp1 only
            optimizer, metrics, grads = train_capturing(cfg, model, records, capture=p.pp == 1)
            adapter_lps = score_rows(model, rows, micro_batch_size=3)
            merge_into_base(model)
            merged_lps = score_rows(model, rows, micro_batch_size=3)
            n_optimized = sum(q.numel() for grp in optimizer.param_groups for q in grp["params"])
            if rank == 0:
                out.setdefault(kind, {})[layout_name(layout)] = dict(
                    base=base_lps,
                    fresh=fresh_lps,
                    adapter=adapter_lps,
                    merged=merged_lps,
                    grads=grads,
                    metrics=metrics,
                    trainable=trainable,
                    n_optimized=n_optimized,
                )
            model = optimizer = None
    destroy_distributed()
    return out if rank == 0 else {}


def finite_differences(rank: int, world: int, hf_dir: str, overrides: list[str]) -> dict:
    from gspo_megatron import factory
    from gspo_megatron.config import load_config
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.lora import lora_modules
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    cfg = load_config(None, overrides)
    init_distributed(ParallelLayout(1, 1, 1, 1, 1, False), seed=cfg.seed)
    model = factory.build_model(cfg, load_hf_config(hf_dir))
    load_hf_weights(model, hf_dir)
    set_random_b(model)
    model = model.double()
    model.config.moe_router_dtype = "fp64"  # the router computes in fp64 too (build sets fp32)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 11), generator=g)
    pos = torch.arange(11)[None].expand(2, 11)
    weights = torch.randn(2, 10, generator=g, dtype=torch.float64)

    def loss() -> torch.Tensor:
        logits = model(ids, pos, None)
        lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
        return (lp * weights).sum()

    params = {n: q for n, q in model.named_parameters() if q.requires_grad}
    loss().backward()
    grads = {n: q.grad.detach().clone() for n, q in params.items()}
    results = {}
    last = f"decoder.layers.{len(model.decoder.layers) - 1}."
    groups = {
        "all": list(params),
        "expert_A": [n for n in params if ".local_experts." in n and n.endswith("lora_A")],
        "expert_B": [n for n in params if ".local_experts." in n and n.endswith("lora_B")],
        "attention": [n for n in params if ".self_attention." in n],
        "last_layer_experts": [n for n in params if n.startswith(last) and ".local_experts." in n],
        "last_layer_fc2_A": [n for n in params if n.startswith(last) and "linear_fc2.lora_A" in n],
    }
    eps = float(__import__("os").environ.get("LORA_FD_EPS", "1e-5"))
    for key, names in groups.items():
        d = {n: torch.randn(params[n].shape, generator=g, dtype=torch.float64) for n in names}
        with torch.no_grad():
            for n in names:
                params[n].add_(eps * d[n])
            up = float(loss())
            for n in names:
                params[n].sub_(2 * eps * d[n])
            down = float(loss())
            for n in names:
                params[n].add_(eps * d[n])
        results[key] = ((up - down) / (2 * eps), float(sum((grads[n] * d[n]).sum() for n in names)), len(names))
    results["modules"] = [n for n, _ in lora_modules(model)]
    destroy_distributed()
    return results
