"""GPU benchmarks of the GPU check kit (bench/gpu_check.py runs them; one process, one GPU, no
SGLang, no Transformer Engine: Megatron's local layer spec).

- ``train``: one GSPO training step (``train_step.train_on_batch``: the old-log-prob pass, then
  ``gspo.mini_batches`` optimizer steps through Megatron's schedule, DDP + distributed optimizer) of a
  Qwen3-MoE-shaped model of ~1.6B parameters in bf16 (hidden 2048, 6 layers, 32 experts of 768,
  top-8, vocab 151,936) on a batch of sequences with RL-like response lengths (log-normal, 16 to
  ``--max-response`` tokens). Reports step seconds, real (non-padding) tokens per second, the share
  of computed tokens that are padding, and model FLOPs utilization:

      MFU = FLOPs / (seconds * peak bf16 dense FLOP/s of the GPU)
      FLOPs = sum over sequences of L * (2 + 6 * mini-batch passes) * (N_active + 2 * layers * L/2 * d_attn)

  (N_active: matmul parameters a token passes through: attention, top-k experts, router, output
  layer; ``2 * layers * (L/2) * d_attn`` the causal attention scores and values; the old-log-prob
  pass is a forward (2 FLOPs per parameter), each training pass forward + backward (6).) Only
  real tokens count, so padding lowers MFU. Run once padded (``parallel.micro_batch_size``) and, when
  the config has ``parallel.max_tokens_per_micro_batch`` (sequence packing), once packed.
- ``export``: the weight-sync export stream (``models.weights.export_hf_weights``: rename to the HF
  layout, bucket) of the same model on one rank: bytes per second of the buckets it yields, against a
  plain device copy of the same bytes in the same run.

Usage: python bench/gpu_bench.py {train,export,all} [--json out.json] [--dry-run] [--tiny]
``--dry-run``: builds the config and counts the model's parameters, no model, no GPU. ``--tiny``: the
same code on the demo's tiny MoE in fp32, on CPU (the kit's dry run runs it; numbers meaningless).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

# bf16 dense peak FLOP/s by device name (vendor datasheets, without sparsity)
PEAK_BF16 = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L40S": 362e12,
}

DIMS = dict(
    hidden_size=2048,
    num_hidden_layers=6,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=32,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    vocab_size=151936,
    max_position_embeddings=40960,
)


def hf_config(tiny: bool = False) -> dict:
    from gspo_megatron.models.qwen3_moe import Qwen3Moe, _published

    if tiny:  # --tiny: the CPU smoke test of this script (the demo's tiny MoE)
        return dict(Qwen3Moe.tiny, model_type="qwen3_moe", max_position_embeddings=4096)
    hf = _published(hidden=2048, ffn=6144, moe_ffn=768, heads=32, layers=6)
    hf.update(DIMS)
    return hf


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_gib() -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def overrides(args, packed: bool) -> list[str]:
    o = [
        f"model.dtype={'float32' if args.tiny else 'bfloat16'}",
        "model.transformer_impl=local",
        "model.init=random",
        f"model.max_seq_len={args.prompt + args.max_response}",
        f"parallel.micro_batch_size={args.micro_batch_size}",
        "gspo.mini_batches=1",
        "optimizer.lr=1e-6",
        f"rollout.max_new_tokens={args.max_response}",
        f"data.max_prompt_len={args.prompt}",
        "model.arch=qwen3-30b-a3b",
    ]
    if packed:
        o.append(f"parallel.max_tokens_per_micro_batch={args.micro_batch_size * (args.prompt + args.max_response)}")
    return o


def has_packing() -> bool:
    from gspo_megatron.config import ParallelConfig

    return "max_tokens_per_micro_batch" in {f.name for f in dataclasses.fields(ParallelConfig)}


def param_counts(hf: dict) -> dict:
    h, L, V = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    d_attn = hf["num_attention_heads"] * hf["head_dim"]
    kv = hf["num_key_value_heads"] * hf["head_dim"]
    attn = h * d_attn + 2 * h * kv + d_attn * h
    expert = 3 * h * hf["moe_intermediate_size"]
    router = h * hf["num_experts"]
    total = L * (attn + hf["num_experts"] * expert + router) + 2 * V * h
    active = L * (attn + hf["num_experts_per_tok"] * expert + router) + V * h  # output layer; not the lookup
    return {"total": total, "active_matmul": active, "d_attn": d_attn, "layers": L}


def response_lengths(n: int, max_response: int, seed: int = 0) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [int(min(max_response, max(16, rnd.lognormvariate(math.log(max_response / 8), 1.0)))) for _ in range(n)]


def model_flops(lengths_total: list[int], pc: dict, passes: int) -> float:
    per = 0.0
    for L in lengths_total:
        per += L * (pc["active_matmul"] + 2 * pc["layers"] * (L / 2) * pc["d_attn"])
    return per * (2 + 6 * passes)


def peak_flops(name: str) -> float | None:
    for k, v in PEAK_BF16.items():
        if k in name:
            return v
    return None


def _build(args, packed: bool):
    import torch

    from gspo_megatron import factory
    from gspo_megatron.config import load_config
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training

    cfg = load_config(None, overrides(args, packed))
    init_distributed(ParallelLayout(), seed=cfg.seed)
    torch.manual_seed(0)
    model = factory.build_model(cfg, hf_config(args.tiny))
    ddp, optimizer, scheduler = setup_training(model, OptimOptions(lr=1e-6, total_steps=4))
    return cfg, model, ddp, optimizer, scheduler


def bench_train(args) -> dict:
    import torch

    from gspo_megatron.sample import Sample
    from gspo_megatron.trainer.step import train_on_batch

    hf = hf_config(args.tiny)
    pc = param_counts(hf)
    resp = response_lengths(args.sequences, args.max_response)
    g = torch.Generator().manual_seed(1)
    records = []
    for i, r in enumerate(resp):
        toks = torch.randint(0, hf["vocab_size"], (args.prompt + r,), generator=g).tolist()
        records.append(Sample.from_tokens(toks, args.prompt, advantage=float((-1) ** i), engine_logprobs=[-1.0] * r))
    totals = [args.prompt + r for r in resp]
    flops = model_flops(totals, pc, passes=1)
    mbs = args.micro_batch_size  # padded layout: rows of mbs sequences, each padded to its longest
    computed = sum(len(totals[i : i + mbs]) * max(totals[i : i + mbs]) for i in range(0, len(totals), mbs))
    padded_frac = 1 - sum(totals) / computed
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = peak_flops(name)
    out = {
        "model": {**{k: hf[k] for k in DIMS}, "params_total": pc["total"], "params_active_matmul": pc["active_matmul"]},
        "sequences": args.sequences,
        "prompt": args.prompt,
        "max_response": args.max_response,
        "real_tokens": sum(totals),
        "device": name,
        "peak_bf16_flops": peak,
        "runs": {},
    }
    if args.dry_run:
        from gspo_megatron.config import load_config

        for packed in (False, True) if has_packing() else (False,):
            load_config(None, overrides(args, packed))
        out["dry_run"] = True
        return out
    cfg, model, ddp, optimizer, scheduler = _build(args, packed=False)
    layouts = [False, True] if has_packing() else [False]
    for packed in layouts:
        if packed:
            from gspo_megatron.config import load_config

            cfg = load_config(None, overrides(args, packed=True))
        train_on_batch(cfg, ddp, optimizer, scheduler, records[: args.micro_batch_size], pad_id=0)  # warm-up
        _sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        metrics = train_on_batch(cfg, ddp, optimizer, scheduler, records, pad_id=0).metrics
        _sync()
        sec = time.perf_counter() - t0
        out["runs"]["packed" if packed else "padded"] = {
            "step_s": sec,
            "tokens_per_s": sum(totals) / sec,
            "mfu": flops / sec / peak if peak else None,
            "padding_frac": metrics.get("perf/padding_frac", None if packed else padded_frac),
            "old_logprob_s": metrics.get("perf/old_logprob_s"),
            "peak_mem_gib": _peak_gib(),
            "loss": metrics.get("loss/total"),
        }
    if not has_packing():
        out["runs"]["packed"] = "not run: this checkout has no parallel.max_tokens_per_micro_batch"
    out["_model"] = model
    return out


def bench_export(args, model=None) -> dict:
    import torch

    from gspo_megatron.models.weights import build_export_plan, export_hf_weights
    from gspo_megatron.weight_sync.sync import bucket_nbytes

    if args.dry_run:
        return {"dry_run": True, "bucket_mb": args.bucket_mb}
    if model is None:
        _, model, *_ = _build(args, packed=False)
    plan = build_export_plan(model)
    bucket = int(args.bucket_mb * 2**20)
    times, nbytes = [], 0
    for _ in range(args.repeats + 1):  # the first is a warm-up
        _sync()
        t0, nbytes = time.perf_counter(), 0
        for b in export_hf_weights(model, bucket, plan=plan):
            nbytes += bucket_nbytes(b or [])
        _sync()
        times.append(time.perf_counter() - t0)
    params = [p for p in model.parameters()]
    copies = []
    for _ in range(args.repeats + 1):
        _sync()
        t0 = time.perf_counter()
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        _sync()
        copies.append(time.perf_counter() - t0)
        del flat
    sec, base = min(times[1:]), min(copies[1:])
    return {
        "bytes": nbytes,
        "bucket_mb": args.bucket_mb,
        "seconds": sec,
        "bytes_per_s": nbytes / sec,
        "plain_copy_s": base,
        "export_over_copy": sec / base,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["train", "export", "all"])
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--max-response", type=int, default=2048)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=512.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="build the config only (no model)")
    ap.add_argument("--tiny", action="store_true", help="the demo's tiny MoE in fp32: runs on CPU (smoke test)")
    args = ap.parse_args(argv)
    res: dict = {}
    model = None
    if args.what in ("train", "all"):
        res["train_step"] = bench_train(args)
        model = res["train_step"].pop("_model", None)
    if args.what in ("export", "all"):
        res["weight_export"] = bench_export(args, model)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
