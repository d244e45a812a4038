"""Rank functions for tests/pipeline/test_fp8_padding.py (module level: spawned ranks import them).

``fp8_vs_plain`` runs the trainer's own code (train_step.split_batch -> pipeline.compute_logprobs ->
run_schedule with the Megatron loss function) on the tiny MoE, padded and packed, once with
``model.fp8`` off and once on (on CPU the model runs unquantized: the flag changes only the padding),
and records the token dim of every input that reaches a tensor-parallel linear layer of the decoder,
as Transformer Engine's ``assert_dim_for_fp8_exec`` would see it (the rank's local input, before any
sequence-parallel all-gather). Then one whole ``train_step.train_on_batch`` with ``model.fp8`` on,
recorded the same way."""

from __future__ import annotations

import math

import packing_workers


def make_records(seed: int = 0, vocab: int = 256) -> list:
    """Mixed lengths (3 .. 61 tokens, odd totals), prompts of 1-3 tokens."""
    return packing_workers.make_records(seed, vocab, lengths=[61, 4, 5, 33, 7, 47, 3, 13, 58, 9, 5, 21, 17])


def config(tp: int, budget: int, fp8: bool, mbs: int = 4, recipe: str = "delayed"):
    """The run's config: the layout, packing budget (0: padded rows) and the FP8 flag."""
    from gspo_megatron.config import load_config

    o = [
        f"parallel.tp={tp}",
        f"parallel.micro_batch_size={mbs}",
        f"parallel.max_tokens_per_micro_batch={budget}",
        "gspo.mini_batches=1",
    ]
    if fp8:
        o += ["model.fp8=e4m3", f"model.fp8_recipe={recipe}", "model.dtype=bfloat16"]
    return load_config(None, o)


def record_linear_inputs(model) -> tuple[list, list]:
    """Forward pre-hooks on the decoder's tensor-parallel linear layers (not the MoE experts, whose
    per-expert token counts Megatron pads itself under FP8): appends (name, leading dims product)
    of every input. Returns (the list, the hook handles)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    seen, handles = [], []
    for name, mod in model.named_modules():
        if ".decoder." not in f".{name}." or ".experts." in f".{name}.":
            continue
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):

            def hook(m, args, name=name):
                seen.append((name, math.prod(args[0].shape[:-1])))

            handles.append(mod.register_forward_pre_hook(hook))
    assert handles, "no tensor-parallel linear layer found in the decoder"
    return seen, handles


def run_pass(ddp, cfg, records: list, ps) -> dict:
    """One pass of the trainer's code: per-sequence log-probs, the global loss, the row shapes."""
    import torch
    import torch.distributed as dist

    from gspo_megatron.losses.megatron_loss import make_megatron_loss_func
    from gspo_megatron.trainer.micro_batches import compute_logprobs, response_values, run_schedule
    from gspo_megatron.trainer.step import loss_config, split_batch

    dp = ps.get_data_parallel_world_size()
    # no ``multiple``: split_batch pads as the trainer does (train_step.row_multiple, model.fp8 included)
    (micro,) = split_batch(cfg, records, dp, ps.get_data_parallel_rank(), pad_id=0)
    out = compute_logprobs(ddp, micro)
    reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    logprobs = {}
    for i, b in enumerate(micro):
        lp = out[i]["logprobs"].float()
        if reporter:
            for sid, vals in zip(b["seq_ids"], response_values(b, lp)):
                logprobs[sid] = vals
        dev = b["seq_index"].device
        sids = torch.tensor([float(s) for s in b["seq_ids"]] or [0.0], device=dev)
        b["old_logprobs"] = lp + 4e-4 * torch.cos(sids[b["seq_index"]] * 1.7 + b["position_ids"] * 0.3) * b["loss_mask"]
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
    loss = torch.tensor([sum(m["loss"] for m in res) if (reporter and res) else 0.0], dtype=torch.float64)
    dist.all_reduce(loss)
    return {"logprobs": logprobs, "loss": float(loss), "shapes": [tuple(b["tokens"].shape) for b in micro]}


def fp8_vs_plain(rank: int, world: int, layouts: list[dict], hf_dir: str, budget: int) -> list:
    """For each layout ({"tp": n}; the rest of the world is DP): padded and packed passes without
    and with ``model.fp8``. Per layout and mode: both passes' results, this rank's gradient
    difference, and the linear layers' input token dims of each pass."""
    from megatron.core import parallel_state as ps

    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training
    from gspo_megatron.trainer.step import train_on_batch

    records = make_records()
    results = []
    for layout in layouts:
        tp = layout.get("tp", 1)
        init_distributed(ParallelLayout(tp=tp, sequence_parallel=tp > 1), seed=0)
        hf = load_hf_config(hf_dir)
        model = build_model(hf, tp, opts=ModelOptions(transformer_impl="local", dtype="float32"))
        load_hf_weights(model, hf_dir)
        ddp, optimizer, scheduler = setup_training(model, OptimOptions(use_distributed_optimizer=False))
        seen, handles = record_linear_inputs(ddp.module)
        entry = {}
        for mode, b in (("padded", 0), ("packed", budget)):
            runs, grads = {}, {}
            for fp8 in (False, True):
                seen.clear()
                runs[fp8] = run_pass(ddp, config(tp, b, fp8), records, ps)
                runs[fp8]["linear_dims"] = list(seen)
                grads[fp8] = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
            entry[mode] = {
                "plain": runs[False],
                "fp8": runs[True],
                "grad_diff": max(float((grads[True][n] - grads[False][n]).abs().max()) for n in grads[False]),
                "grad_max": max(float(g.abs().max()) for g in grads[False].values()),
            }
        # the trainer's whole step with model.fp8 on (packed), as train.py calls it
        seen.clear()
        metrics = train_on_batch(config(tp, budget, True), ddp, optimizer, scheduler, records, pad_id=0).metrics
        entry["train_on_batch"] = {"linear_dims": list(seen), "loss": metrics["loss/total"]}
        for h in handles:
            h.remove()
        results.append(entry)
    destroy_distributed()
    return results


def cp_rows(rank: int, world: int, tp: int, budget: int) -> list:
    """Context parallel over the ``world`` gloo ranks (the model cannot run CP on CPU): the
    trainer's split_batch with ``model.fp8`` on, ``tp`` given; this CP rank's [b, s/cp] shapes."""
    import torch.distributed as dist

    from gspo_megatron.trainer.step import split_batch

    dist.init_process_group("gloo")
    (micro,) = split_batch(config(tp, budget, True), make_records(), 1, 0, pad_id=0, cp_group=dist.group.WORLD, tp=tp)
    return [(tuple(b["tokens"].shape), float(b["loss_mask"].sum()), int(b["num_computed_tokens"])) for b in micro]
