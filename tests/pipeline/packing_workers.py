"""Rank functions for the packing tests (module level: spawned ranks import them).

``packed_vs_padded`` runs, in each layout, the trainer's own code (train_step.split_batch ->
pipeline.compute_logprobs -> run_schedule with the Megatron loss function, finalize_model_grads)
once with padded micro-batches and once packed, and reports per-sequence log-probs, the global loss
and this rank's (DP-reduced) gradients for both."""

from __future__ import annotations

import math

LENGTHS = [61, 4, 5, 33, 6, 47, 4, 12, 58, 7, 5, 21]


def make_records(seed: int = 0, vocab: int = 256, lengths: list[int] = LENGTHS) -> list:
    """Samples of ``lengths`` tokens (by default differing by more than 10x: 4 .. 61), prompts of 1-3 tokens."""
    import torch

    from gspo_megatron.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        p = 1 + i % 3
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        out.append(
            Sample.from_tokens(
                ids,
                p,
                engine_logprobs=(-torch.rand(n - p, generator=g) * 3).tolist(),
                advantage=float(torch.randn((), generator=g)),
            )
        )
    return out


def _config(budget: int, mbs: int):
    from gspo_megatron.config import load_config

    return load_config(
        None,
        [f"parallel.micro_batch_size={mbs}", f"parallel.max_tokens_per_micro_batch={budget}", "gspo.mini_batches=1"],
    )


def run_pass(ddp, cfg, records: list, ps) -> dict:
    """One padded or packed pass with the trainer's code: {"logprobs": {seq id: list}, "loss": float,
    "num_micro": int, "pad": (computed, real)}; gradients are left in the DDP buffers."""
    import torch
    import torch.distributed as dist

    from gspo_megatron.losses.megatron_loss import make_megatron_loss_func
    from gspo_megatron.trainer.micro_batches import compute_logprobs, response_values, run_schedule, sequence_multiple
    from gspo_megatron.trainer.step import loss_config, split_batch

    dp, tp = ps.get_data_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    (micro,) = split_batch(cfg, records, dp, ps.get_data_parallel_rank(), pad_id=0, multiple=sequence_multiple(tp, 1))
    out = compute_logprobs(ddp, micro)
    reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    logprobs = {}
    for i, b in enumerate(micro):
        lp = out[i]["logprobs"].float() if out is not None else torch.zeros_like(b["loss_mask"])
        if reporter:
            for sid, vals in zip(b["seq_ids"], response_values(b, lp)):
                logprobs[sid] = vals
        # old log-probs: the model's own, shifted by a deterministic function of (sequence, position)
        # so that sequence ratios differ from 1 and both sides of the clip occur
        dev = b["seq_index"].device
        sids = torch.tensor([float(s) for s in b["seq_ids"]] or [0.0], device=dev)
        shift = 4e-4 * torch.cos(sids[b["seq_index"]] * 1.7 + b["position_ids"] * 0.3)
        b["old_logprobs"] = lp + shift * b["loss_mask"]
    ddp.zero_grad_buffer()
    res = run_schedule(
        ddp,
        micro,
        lambda b: make_megatron_loss_func(
            b,
            loss_config(cfg),
            tp_group=ps.get_tensor_model_parallel_group(),
            cp_group=None,
            num_microbatches=len(micro),
            data_parallel_size=dp,
            compute_entropy=True,
        ),
        forward_only=False,
    )
    loss = torch.tensor(
        [sum(m["loss"] for m in res) if (reporter and res) else 0.0],
        dtype=torch.float64,
        device=micro[0]["tokens"].device,
    )  # NCCL's device on GPU
    dist.all_reduce(loss)
    computed = sum(int(b["tokens"].numel()) for b in micro)
    real = sum(int(b["num_real_tokens"]) for b in micro)
    return {
        "logprobs": logprobs,
        "loss": float(loss),
        "num_micro": len(micro),
        "pad": (computed, real),
        "tokens_per_micro": [int(b["tokens"].numel()) for b in micro],
        "real_per_micro": [int(b["num_real_tokens"]) for b in micro],
    }


def packed_vs_padded(
    rank: int,
    world: int,
    layouts: list[dict],
    hf_dir: str,
    budget: int,
    mbs: int = 4,
    impl: str = "local",
    dtype: str = "float32",
) -> list:
    """For each layout: padded and packed passes; returns per layout {"padded": ..., "packed": ...,
    "grad_diff": max |g_packed - g_padded| over this rank's parameters, "grad_max": max |g_padded|}."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.runtime.distributed import destroy_distributed
    from gspo_megatron.score import score_rows
    from tiny_models import tiny_megatron_model

    records = make_records()
    results = []
    for layout in layouts:
        ddp, _, _ = tiny_megatron_model(hf_dir, layout, impl, dtype)
        entry, grads = {}, {}
        for name, b in (("padded", 0), ("packed", budget)):
            entry[name] = run_pass(ddp, _config(b, mbs), records, ps)
            grads[name] = {
                n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters() if p.requires_grad
            }  # frozen ones (the DSA indexer) have no main_grad
        entry["grad_diff"] = max(float((grads["packed"][n] - grads["padded"][n]).abs().max()) for n in grads["padded"])
        entry["grad_max"] = max(float(g.abs().max()) for g in grads["padded"].values())
        entry["finite"] = all(math.isfinite(float(g.abs().sum())) for g in grads["packed"].values())
        # the scorer (tools/score.py's library side), padded rows vs packed rows
        rows = [r.tokens for r in records]
        padded_scores = score_rows(ddp, rows, micro_batch_size=mbs)
        packed_scores = score_rows(ddp, rows, max_tokens_per_micro_batch=budget)
        if padded_scores is not None:
            entry["score"] = (padded_scores, packed_scores)
        results.append(entry)
    destroy_distributed()
    return results


def packed_vs_padded_1_rank_tp2_ep2(hf_dir: str, budget: int) -> dict[str, list[dict]]:
    """``packed_vs_padded`` (default layout each) on 1 rank, then tp2 and ep2 on two ranks (the family
    tests' three layouts): {"tp1" | "tp2" | "ep2": each rank's entry}."""
    from distributed_harness import run_ranks

    results = {"tp1": [run_ranks(packed_vs_padded, 1, [dict()], hf_dir, budget)[0][0]]}
    two = run_ranks(packed_vs_padded, 2, [dict(tp=2), dict(ep=2)], hf_dir, budget)
    results.update(tp2=[r[0] for r in two], ep2=[r[1] for r in two])
    return results


def cp_round_trip(rank: int, world: int) -> tuple:
    """Context parallel on a packed micro-batch: this rank's share and the gathered row."""
    import torch.distributed as dist

    from gspo_megatron.trainer.micro_batches import sequence_multiple, split_for_context_parallel
    from gspo_megatron.trainer.packing import collate_packed, gather_packed_context_parallel

    dist.init_process_group("gloo")
    recs = make_records()[:5]
    for r in recs:
        r.old_logprobs = [float(j) for j in range(r.response_len)]
    batch = collate_packed(recs, seg_multiple=2 * world, row_multiple=sequence_multiple(1, world))
    local = split_for_context_parallel(batch, dist.group.WORLD)
    back = {
        k: gather_packed_context_parallel(local[k], batch["cu_seqlens"], dist.group.WORLD)
        for k in ("tokens", "position_ids", "labels", "loss_mask", "seq_index", "old_logprobs")
    }
    return batch, local, back
