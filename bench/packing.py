"""Padded vs packed micro-batches on RL-like response lengths, measured in one run.

Both modes run the trainer's own step (``train_step.train_on_batch``'s phases: split_batch -> old
log-prob pass -> forward-backward + optimizer step) on the same records, alternating padded and packed
steps so both see the same machine load:

- padded: ``parallel.micro_batch_size`` rows per micro-batch, each right-padded to its longest row
  (records in rollout order, as the trainer takes them);
- packed: ``parallel.max_tokens_per_micro_batch`` = micro_batch_size * max_seq_len (the same
  worst-case micro-batch), whole sequences concatenated (``gspo_megatron.trainer.packing``).

Records: P prompts x G responses; prompt lengths uniform in [16, 48]; response lengths long-tailed
like RL's: log-normal (median 40 tokens, sigma 1.2), capped at the budget (max_seq_len - prompt),
so most responses are short and a few run to the limit.

Reported per mode (medians over ``--repeats`` steps): padding fraction of the computed tokens
(``perf/padding_frac``), tokens/s of the old log-prob pass and of the training pass (forward-backward
+ optimizer step) as real tokens / time (on CPU: this thread's CPU time with one intra-op thread, so
a busy shared machine does not distort the ratio; on GPU: wall time), and peak memory: on GPU, torch.cuda.max_memory_allocated over each pass minus the memory
held before it; on CPU, the largest activation footprint of one micro-batch (bytes of the distinct
non-parameter tensors autograd saves for backward during its forward, via saved_tensors_hooks),
since a process-wide CPU high-water mark cannot be reset between passes. Then packed / padded ratios.

The model: the tiny Qwen3-MoE family config (4 experts, top-2) with ``--hidden`` / ``--layers``;
one rank; fp32 on CPU, bf16 on GPU; Transformer Engine's THD attention on GPU, the local spec (segment-by-segment
causal attention) on CPU.

Usage: python bench/packing.py [--prompts 8] [--group-size 8] [--max-seq-len 512]
         [--micro-batch-size 8] [--hidden 128] [--layers 2] [--repeats 3] [--output result.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def make_records(prompts: int, group: int, max_seq_len: int, vocab: int, seed: int = 0) -> list:
    from gspo_megatron.sample import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(prompts):
        p = int(torch.randint(16, 49, (), generator=g))
        prompt = torch.randint(0, vocab, (p,), generator=g).tolist()
        for _ in range(group):
            r = math.ceil(math.exp(math.log(40) + 1.2 * float(torch.randn((), generator=g))))
            r = max(2, min(r, max_seq_len - p))
            resp = torch.randint(0, vocab, (r,), generator=g).tolist()
            out.append(
                Sample(
                    prompt_ids=list(prompt),
                    response_ids=resp,
                    advantage=float(torch.randn((), generator=g)),
                    engine_logprobs=(-torch.rand(r, generator=g) * 3).tolist(),
                )
            )
    return out


class ActivationMeter:
    """Largest per-micro-batch footprint of tensors saved for backward (distinct storages, parameters
    excluded): reset at each forward of ``module``, read after it."""

    def __init__(self, module):
        self.params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.live: dict[int, int] = {}
        self.peak = 0
        module.register_forward_pre_hook(lambda *a: self.live.clear())
        module.register_forward_hook(lambda *a: self._done())

    def _done(self):
        self.peak = max(self.peak, sum(self.live.values()))

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.params:
            self.live[s.data_ptr()] = s.nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def one_step(cfg, ddp, optimizer, scheduler, records, gpu: bool) -> tuple[float, float, float]:
    """The trainer's step (train_step.train_on_batch's phases, each timed): micro-batches, the old
    log-prob pass, forward-backward + optimizer step. Returns (padding fraction, old-pass seconds,
    training seconds); seconds are this thread's CPU time on CPU (robust to a busy shared machine;
    one intra-op thread), wall time after synchronizing on GPU."""

    from gspo_megatron.losses.megatron_loss import make_megatron_loss_func
    from gspo_megatron.trainer.micro_batches import run_schedule
    from gspo_megatron.trainer.optimizer import optimizer_step, zero_grads
    from gspo_megatron.trainer.packing import padding_counts
    from gspo_megatron.trainer.step import _attach_logprobs, loss_config, split_batch

    def clock():
        if gpu:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    (micro,) = split_batch(cfg, records, 1, 0, pad_id=0, multiple=1)
    computed, real = padding_counts(micro)
    t0 = clock()
    _attach_logprobs(ddp, micro, "old_logprobs", cfg.rollout.temperature)
    t1 = clock()
    zero_grads(ddp, optimizer)
    run_schedule(
        ddp,
        micro,
        lambda b: make_megatron_loss_func(
            b,
            loss_config(cfg),
            tp_group=None,
            cp_group=None,
            num_microbatches=len(micro),
            data_parallel_size=1,
            compute_entropy=True,
            check_finite=False,
        ),
        forward_only=False,
    )
    optimizer_step(optimizer, scheduler)
    t2 = clock()
    return 1.0 - real / computed, t1 - t0, t2 - t1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from gspo_megatron.config import load_config
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training

    gpu = torch.cuda.is_available()
    if not gpu:
        torch.set_num_threads(1)  # CPU time of one thread measures the work, whatever the machine's load
    n = args.prompts * args.group_size
    common = [
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        f"model.max_seq_len={args.max_seq_len}",
        "gspo.mini_batches=1",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"parallel.micro_batch_size={args.micro_batch_size}",
        "optimizer.lr=1e-5",
    ]
    if n % args.micro_batch_size:
        raise SystemExit(f"--prompts * --group-size = {n} must be divisible by --micro-batch-size")
    budget = args.micro_batch_size * args.max_seq_len
    cfgs = {
        "padded": load_config(None, common),
        "packed": load_config(None, common + [f"parallel.max_tokens_per_micro_batch={budget}"]),
    }
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        save_tiny_hf_model(
            "qwen3_moe",
            hf_dir,
            seed=0,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            max_position_embeddings=max(512, args.max_seq_len),
            head_dim=args.hidden // 4,
            moe_intermediate_size=args.hidden // 2,
            intermediate_size=args.hidden * 2,
        )
        init_distributed(ParallelLayout(), seed=0)
        hf = load_hf_config(hf_dir)
        # GPU: bf16 (Transformer Engine's THD attention kernels are fp16/bf16 ones); CPU: fp32
        model = build_model(hf, opts=ModelOptions(transformer_impl="auto", dtype="bfloat16" if gpu else "float32"))
        load_hf_weights(model, hf_dir)
        ddp, optimizer, scheduler = setup_training(model, OptimOptions(lr=1e-5, use_distributed_optimizer=False))
        meter = ActivationMeter(ddp.module)
        records = make_records(args.prompts, args.group_size, args.max_seq_len, hf["vocab_size"])
        real = sum(r.length for r in records)
        stats = {
            m: {"old_s": [], "train_s": [], "pad": None, "act_peak": 0, "gpu_old": 0, "gpu_train": 0} for m in cfgs
        }
        for rep in range(args.repeats + 1):  # the first round warms up
            for mode, cfg in cfgs.items():
                meter.peak = 0
                if gpu:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                with meter.hooks():
                    pad, old_s, train_s = one_step(cfg, ddp, optimizer, scheduler, records, gpu)
                s = stats[mode]
                s["pad"] = pad
                s["act_peak"] = max(s["act_peak"], meter.peak)
                if gpu:
                    s["gpu_peak"] = max(s.get("gpu_peak", 0), torch.cuda.max_memory_allocated() - base)
                if rep:
                    s["old_s"].append(old_s)
                    s["train_s"].append(train_s)
        destroy_distributed()
    if dist.is_initialized():
        dist.destroy_process_group()

    lengths = sorted(r.response_len for r in records)
    res = {
        "device": torch.cuda.get_device_name() if gpu else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "sequences": n,
        "real_tokens": real,
        "response_len": {
            "min": lengths[0],
            "median": lengths[len(lengths) // 2],
            "max": lengths[-1],
            "mean": statistics.fmean(lengths),
        },
        "max_seq_len": args.max_seq_len,
        "micro_batch_size": args.micro_batch_size,
        "budget": budget,
        "model": {"hidden": args.hidden, "layers": args.layers, "experts": 4},
        "modes": {},
    }
    for mode, s in stats.items():
        old, train = statistics.median(s["old_s"]), statistics.median(s["train_s"])
        res["modes"][mode] = {
            "padding_frac": s["pad"],
            "old_logprob_tokens_per_s": real / old,
            "train_tokens_per_s": real / train,
            "old_logprob_s": old,
            "train_s": train,
            "activation_peak_mib": s["act_peak"] / 2**20,
            **({"gpu_peak_mib": s["gpu_peak"] / 2**20} if gpu else {}),
        }
    a, b = res["modes"]["padded"], res["modes"]["packed"]
    res["ratios_packed_over_padded"] = {
        "old_logprob_tokens_per_s": b["old_logprob_tokens_per_s"] / a["old_logprob_tokens_per_s"],
        "train_tokens_per_s": b["train_tokens_per_s"] / a["train_tokens_per_s"],
        "activation_peak": b["activation_peak_mib"] / a["activation_peak_mib"],
        **({"gpu_peak": b["gpu_peak_mib"] / a["gpu_peak_mib"]} if gpu else {}),
    }
    print(
        f"device: {res['device']}; {n} sequences, {real} real tokens; response length min/median/mean/max "
        f"{lengths[0]}/{res['response_len']['median']}/{res['response_len']['mean']:.0f}/{lengths[-1]}; "
        f"max_seq_len {args.max_seq_len}; padded: {args.micro_batch_size} rows/micro-batch; packed: "
        f"budget {budget} tokens"
    )
    for mode, r in res["modes"].items():
        print(
            f"{mode:>7}: padding {100 * r['padding_frac']:5.1f}% of computed tokens | old log-probs "
            f"{r['old_logprob_tokens_per_s']:9.0f} tok/s | train {r['train_tokens_per_s']:9.0f} tok/s | "
            f"activations {r['activation_peak_mib']:8.1f} MiB"
            + (f" | GPU peak {r['gpu_peak_mib']:8.1f} MiB" if gpu else "")
        )
    print("packed / padded: " + ", ".join(f"{k} {v:.2f}x" for k, v in res["ratios_packed_over_padded"].items()))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    sys.exit(main())
