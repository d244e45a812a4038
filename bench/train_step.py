"""Tokens per second of one GSPO step: gspo-megatron vs. TRL's GRPOTrainer (GSPO mode), same run.

Both train the CPU demo model (configs/demo_cpu.yaml: tiny random-init Qwen3-MoE, byte tokenizer,
built-in ``last_digit`` task) from the *same* starting weights (``hf_init``, the HF export our trainer
starts from, loaded by TRL), on the *same* prompts in the same order (our dataset and sampler; the
prompt token ids are checked equal every step), with settings taken from one resolved Config:

- group size G (TRL ``num_generations``), prompts per step P, max_new_tokens (TRL
  ``max_completion_length``), temperature / top_p / top_k, fp32, CPU, no vLLM;
- step batch P * G sequences, cut into ``gspo.mini_batches`` M optimizer steps of P * G / M sequences
  each (ours: one micro-batch per mini-batch; TRL: ``per_device_train_batch_size`` = P * G / M,
  ``steps_per_generation`` = M, no gradient accumulation);
- loss: sequence-level ratio (TRL ``importance_sampling_level="sequence"``), clip eps from the config
  (3e-4 / 4e-4), mean over tokens then over sequences (TRL ``loss_type="grpo"``), beta = 0 (no
  reference model), group-std-normalized advantages, the config's entropy bonus (TRL ``entropy_coef``);
- optimizer: Adam, same lr / betas / eps / weight decay / grad-norm clip, constant schedule;
- reward: ``TASKS["last_digit"].reward`` on the response decoded as ours does (final EOS dropped,
  other special tokens kept), adapted to TRL's reward-function signature through ``completion_ids``;
- ``rollout.dynamic_sampling`` is forced off (TRL cannot resample zero-variance groups).

A "step" is one rollout batch: generation + rewards + old log-probs + M optimizer steps (+ our weight
sync). Tokens per step = prompt + completion tokens of the step's P * G sequences (completion includes
the EOS token when generation stopped on it), counted the same way for both; tokens/s = measured
tokens / measured step time over the ``--steps`` steps after ``--warmup`` steps.

Modes: ``interleaved`` (default) runs both in this process and alternates their steps (TRL step k, then
our step k), so both see the same machine load; ours is then set up exactly as
``gspo_megatron.train.train`` does and each step runs train.py's loop body (rollout, records broadcast,
``train_on_batch``, weight sync), minus metrics logging and checkpoints. ``sequential`` runs
``gspo-train`` as a subprocess (as shipped), then TRL in this process. On a machine busy with other
work, a lone process suffers far more than its share (OpenMP worker threads spin-wait while the main
thread is descheduled; measured here: TRL alone 1.4-5 s/step vs 0.3 s/step interleaved at the same
load), so compare sequential numbers only on an idle machine.

What differs (printed with the results):
- generation: ours samples with the rollout engine (a separate transformers copy of the policy, its
  own KV-cache sampling loop) that receives the trainer's weights through an in-process sync after
  every step; TRL samples with the training model itself through ``model.generate`` (no sync);
- training: ours is Megatron-Core (GPTModel, MoE layers, distributed optimizer with fp32 main grads,
  forward-backward schedule); TRL is transformers' Qwen3MoeForCausalLM + torch AdamW via Trainer;
- old log-probs: ours always recomputes them with the trainer model; TRL does only when
  ``steps_per_generation`` > 1 (with ``--mini-batches 1`` it reuses the detached current ones);
- same prompts, but different random streams: responses (and so tokens/step) differ slightly.

Usage: python bench/train_step.py [--steps 5] [--warmup 2] [--prompts 16] [--group-size 8]
         [--mini-batches 2] [--max-new-tokens N] [--mode interleaved|sequential] [--output result.json]
Defaults run in well under a minute on 2 idle CPU cores (interleaved). Needs ``trl`` (pip install trl).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from train_step_trl import Side, run_trl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(REPO, "configs", "demo_cpu.yaml")

DIFFERENCES = [
    "generation: ours = rollout engine (separate transformers copy, own KV-cache sampling loop) + "
    "in-process weight sync each step; TRL = model.generate on the training model (no sync)",
    "training: ours = Megatron-Core GPTModel + distributed optimizer (fp32 main grads); "
    "TRL = transformers Qwen3MoeForCausalLM + torch AdamW (Trainer)",
    "old log-probs: ours always recomputes them; TRL only when steps_per_generation > 1",
    "tokens counted alike: prompt + completion (incl. EOS) tokens of the step's P*G sequences",
    "same prompts in the same order; different RNG streams, so responses/tokens per step differ slightly",
]
MODE_NOTE = {
    "interleaved": "both in this process, steps interleaved (TRL step k, then our step k) so both see the same "
    "machine load; ours is set up as gspo-train does, minus metrics logging and checkpoints",
    "sequential": "ours = gspo-train subprocess (run first, as shipped); TRL = in this process (run second)",
}


def overrides_for(args, workdir: str) -> list[str]:
    """Dotted overrides applied to the demo config, for our run and for deriving TRL's settings."""
    n = args.prompts * args.group_size
    if n % args.mini_batches:
        raise SystemExit(f"--prompts * --group-size = {n} must be divisible by --mini-batches {args.mini_batches}")
    return [
        f"output_dir={os.path.join(workdir, 'ours')}",
        f"train.steps={args.warmup + args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.group_size={args.group_size}",
        f"gspo.mini_batches={args.mini_batches}",
        f"parallel.micro_batch_size={n // args.mini_batches}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "checkpoint.interval=0",
        # TRL has no resampling of zero-variance groups: one generation round per step on both sides
        "rollout.dynamic_sampling=false",
        *([f"rollout.max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []),
    ]


def check_config(cfg) -> None:
    """The settings both sides can share; anything else would make the comparison unequal."""
    bad = []
    if cfg.model.dtype != "float32":
        bad.append(f"model.dtype={cfg.model.dtype} (need float32)")
    if cfg.rollout.engine != "hf":
        bad.append(f"rollout.engine={cfg.rollout.engine} (need hf: CPU, no SGLang / vLLM)")
    if cfg.rollout.dynamic_sampling:
        bad.append("rollout.dynamic_sampling=true (TRL has no resampling; prompts would not match)")
    if cfg.rollout.stop:
        bad.append(f"rollout.stop={cfg.rollout.stop} (TRL stops on EOS only)")
    if cfg.gspo.mode != "gspo" or cfg.gspo.loss_agg != "seq-mean-token-mean":
        bad.append(f"gspo.mode={cfg.gspo.mode}, gspo.loss_agg={cfg.gspo.loss_agg} (need gspo, seq-mean-token-mean)")
    if cfg.gspo.kl_coef or cfg.gspo.tis_cap:
        bad.append("gspo.kl_coef / tis_cap must be 0 / null (no reference model, no engine-gap correction)")
    if cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.ep != 1:
        bad.append("parallel.tp/pp/ep must be 1 (one CPU process)")
    if bad:
        raise SystemExit("bench/train_step.py: config not comparable with TRL: " + "; ".join(bad))


def step_prompts(cfg, tokenizer, num_steps: int) -> list[list]:
    """The PromptRows our trainer draws at each step (same dataset and sampler as train.py)."""
    from gspo_megatron import factory
    from gspo_megatron.data.dataset import PromptSampler

    dataset = factory.build_dataset(cfg, tokenizer)
    sampler = PromptSampler(len(dataset), seed=cfg.seed, shuffle=cfg.data.shuffle)
    return [[dataset[i] for i in sampler.next_indices(cfg.rollout.prompts_per_step)] for _ in range(num_steps)]


# ------------------------------------------------------------------------------------------ ours
def run_ours(args, overrides: list[str], workdir: str) -> Side:
    """gspo-train in a subprocess; per-step numbers from its metrics.jsonl."""
    out_dir = os.path.join(workdir, "ours")
    log_path = os.path.join(workdir, "ours.log")
    cmd = [sys.executable, "-m", "gspo_megatron.train", "--config", args.config, *overrides]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.call(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise SystemExit(f"gspo-train exited with {rc} ({' '.join(cmd)}); log {log_path}:\n{tail}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = sorted(rows, key=lambda r: r["step"])[args.warmup :]
    side = Side("gspo-megatron", wall_s=wall)
    for r in rows:
        side.step_s.append(r["perf/step_time_s"])
        side.tokens.append(r["perf/tokens_per_s"] * r["perf/step_time_s"])  # = sum(len(tokens)) of the step
        side.rollout_s.append(r["perf/rollout_s"])
        side.old_logprob_s.append(r["perf/old_logprob_s"])
        side.train_s.append(r["perf/train_s"])
        side.sync_s.append(r["sync/total_s"])
        side.reward_mean.append(r["reward/mean"])
        side.response_len.append(r["rollout/response_len_mean"])
    return side


class OursInProcess:
    """gspo-megatron's trainer in this process, set up as ``gspo_megatron.train.train`` does (world
    of one), stepped one rollout batch at a time so it can be interleaved with TRL's steps."""

    def __init__(self, cfg):
        from gspo_megatron import factory
        from gspo_megatron.config import validate, validate_model_layout, values_for
        from gspo_megatron.data.dataset import PromptSampler
        from gspo_megatron.models.arch import model_hf_config
        from gspo_megatron.models.hf_config import load_hf_config
        from gspo_megatron.models.weights import load_hf_weights
        from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
        from gspo_megatron.trainer.optimizer import OptimOptions, setup_training
        from gspo_megatron.weight_sync.sync import WeightSyncer

        warnings.filterwarnings("ignore", module=r"megatron\.")  # CPU-fallback notices (no apex / TE)
        t0 = time.perf_counter()
        validate(cfg, world_size=1)
        validate_model_layout(cfg, model_hf_config(cfg)[0])
        p = cfg.parallel
        init_distributed(ParallelLayout(p.tp, p.pp, p.ep, p.etp, p.cp, bool(p.sequence_parallel)), seed=cfg.seed)
        hf_dir = factory.hf_init_dir(cfg)
        model = factory.build_model(cfg, load_hf_config(hf_dir))
        self.ddp, self.optimizer, self.scheduler = setup_training(
            model,
            OptimOptions(
                **values_for(
                    OptimOptions, cfg.optimizer, cfg.parallel, total_steps=cfg.train.steps * cfg.gspo.mini_batches
                )
            ),
        )
        load_hf_weights(model, hf_dir)
        self.optimizer.reload_model_params()  # bf16: the fp32 main params from the loaded weights (train.resume)
        self.tokenizer = factory.build_tokenizer(hf_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.dataset = factory.build_dataset(cfg, self.tokenizer)
        self.sampler = PromptSampler(len(self.dataset), seed=cfg.seed, shuffle=cfg.data.shuffle)
        self.rewards = factory.build_rewards(cfg)
        rollout = factory.build_engines(cfg, hf_dir)
        self.engine = rollout.engine
        self.syncer = WeightSyncer(model, rollout.topology, cfg.rollout.sync_bucket_mb)
        self.syncer.sync()  # the engine starts from the trainer's weights
        self.cfg, self.side, self.steps_done = cfg, Side("gspo-megatron"), 0
        self.side.wall_s = time.perf_counter() - t0  # (setup; steps are added as they run)

    def step(self, measured: bool) -> None:
        """One step of train.py's loop: rollout -> records to every rank -> train -> weight sync."""
        import torch.distributed as dist

        from gspo_megatron.orchestration.batch import collect_rollouts
        from gspo_megatron.trainer.step import train_on_batch

        self.steps_done += 1
        t0 = time.perf_counter()
        batch = collect_rollouts(
            self.cfg, self.steps_done, self.engine, self.dataset, self.sampler, self.tokenizer, self.rewards
        )
        box = [("ok", batch.records)]
        dist.broadcast_object_list(box, src=0)  # as train.py (a world of one here)
        m = train_on_batch(self.cfg, self.ddp, self.optimizer, self.scheduler, box[0][1], self.pad_id).metrics
        sync = self.syncer.sync()
        step_s = time.perf_counter() - t0
        self.side.wall_s += step_s
        if not measured:
            return
        s, bm = self.side, batch.metrics
        s.step_s.append(step_s)
        s.tokens.append(float(sum(r.length for r in batch.records)))
        s.rollout_s.append(bm["perf/rollout_s"])
        s.old_logprob_s.append(m["perf/old_logprob_s"])
        s.train_s.append(m["perf/train_s"])
        s.sync_s.append(sync["sync/total_s"])
        s.reward_mean.append(bm["reward/mean"])
        s.response_len.append(bm["rollout/response_len_mean"])

    def close(self) -> None:
        from gspo_megatron.runtime.distributed import destroy_distributed

        self.rewards.close()
        self.engine.shutdown()
        destroy_distributed()


# ----------------------------------------------------------------------------------------- report
def format_table(ours: Side | None, trl: Side | None) -> str:
    rows = [
        ("tokens/s (all steps)", "tokens_per_s", "{:.0f}"),
        ("tokens/s (median)", "tokens_per_s_median", "{:.0f}"),
        ("step time (s)", "step_time_s", "{:.3f}"),
        ("tokens/step", "tokens_per_step", "{:.0f}"),
        ("  rollout (s)", "rollout_s", "{:.3f}"),
        ("    generate (s)", "generate_s", "{:.3f}"),
        ("  old log-probs (s)", "old_logprob_s", "{:.3f}"),
        ("  train (s)", "train_s", "{:.3f}"),
        ("  weight sync (s)", "sync_s", "{:.4f}"),
        ("response len", "response_len_mean", "{:.2f}"),
        ("reward mean", "reward_mean", "{:.3f}"),
        ("wall incl. setup (s)", "process_wall_s", "{:.1f}"),
    ]
    a = ours.summary() if ours else {}
    b = trl.summary() if trl else {}

    def cell(d, key, fmt):
        return fmt.format(d[key]) if d.get(key) is not None else "-"

    lines = [f"{'':22s}{'gspo-megatron':>15s}{'TRL (GSPO)':>15s}{'ours/TRL':>10s}"]
    for label, key, fmt in rows:
        ratio = "-"
        if a.get(key) is not None and b.get(key):
            ratio = f"{a[key] / b[key]:.2f}x"
        lines.append(f"{label:22s}{cell(a, key, fmt):>15s}{cell(b, key, fmt):>15s}{ratio:>10s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="measured steps per implementation")
    ap.add_argument("--warmup", type=int, default=2, help="steps run first and excluded")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step (P)")
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt (G)")
    ap.add_argument("--mini-batches", type=int, default=2, choices=(1, 2), help="optimizer steps per step (M)")
    ap.add_argument("--max-new-tokens", type=int, help="max response tokens (default: the config's)")
    ap.add_argument("--config", default=DEMO_CONFIG, help="base config (default: the CPU demo)")
    ap.add_argument(
        "--mode",
        choices=("interleaved", "sequential"),
        default="interleaved",
        help="interleaved: both in process, alternating steps (fair on a busy machine); "
        "sequential: gspo-train as a subprocess first, then TRL",
    )
    ap.add_argument("--only", choices=("ours", "trl"), help="run one side only (ours: as a gspo-train subprocess)")
    ap.add_argument("--workdir", help="where runs are written (default: a temporary directory, removed)")
    ap.add_argument("--output", help="write the result as JSON here")
    args = ap.parse_args(argv)
    for name in ("steps", "prompts"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.group_size < 2:
        raise SystemExit("--warmup must be >= 0 and --group-size >= 2")

    import transformers

    from gspo_megatron.config import load_config
    from gspo_megatron.data.tokenizer import load_tokenizer

    transformers.utils.logging.disable_progress_bar()

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench_train_step_")
    workdir = args.workdir or tmp.name
    os.makedirs(workdir, exist_ok=True)
    if os.path.exists(os.path.join(workdir, "ours", "checkpoints")):  # gspo-train would resume from it
        raise SystemExit(f"--workdir {workdir} holds an earlier run (ours/checkpoints); use an empty directory")
    overrides = overrides_for(args, workdir)
    cfg = load_config(args.config, overrides)
    check_config(cfg)
    P, G, M = args.prompts, args.group_size, args.mini_batches
    print(
        f"GSPO step throughput, {os.path.relpath(args.config, REPO)}: P={P} prompts x G={G} = {P * G} "
        f"sequences/step, max_new_tokens={cfg.rollout.max_new_tokens}, {M} optimizer step(s)/step, "
        f"fp32 CPU, torch threads={torch.get_num_threads()}; {args.warmup} warmup + {args.steps} measured steps",
        flush=True,
    )

    load0 = os.getloadavg()[0]
    ours = trl = None
    hf_dir = os.path.join(cfg.output_dir, "hf_init")
    mode = "sequential" if args.only else args.mode
    if mode == "sequential" and args.only != "trl":
        print("gspo-megatron (gspo-train subprocess) ...", flush=True)
        ours = run_ours(args, overrides, workdir)
    if args.only != "ours":
        from gspo_megatron import factory

        factory.hf_init_dir(cfg)  # the starting weights (written once; our run reads the same files)
        prompts = step_prompts(cfg, load_tokenizer(hf_dir), args.warmup + args.steps)
        if mode == "interleaved":
            print(
                "TRL GRPOTrainer (importance_sampling_level=sequence) and gspo-megatron, alternating steps, "
                "in process ...",
                flush=True,
            )
            trl, stepper = run_trl(args, cfg, hf_dir, prompts, workdir, setup_other=lambda: OursInProcess(cfg))
            ours = stepper.side
            stepper.close()
        else:
            print("TRL GRPOTrainer, importance_sampling_level=sequence (in process) ...", flush=True)
            trl, _ = run_trl(args, cfg, hf_dir, prompts, workdir)

    table = format_table(ours, trl)
    print()
    print(table)
    print(
        "\ntokens = prompt + completion (incl. EOS) tokens of the step's sequences. tokens/s (all steps) = "
        "measured tokens / measured step time; (median) = the median step's. Times: medians per step; "
        "reward and response length: means."
    )
    print(f"load average (1 min) at start / end: {load0:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if max(load0, os.getloadavg()[0]) > (os.cpu_count() or 1):
        print(
            "WARNING: the machine was busy with other work during the run; timings are noisy"
            + (
                " (both sides alternated steps, so they saw the same load)"
                if mode == "interleaved"
                else " and a lone process suffers more than its share: use --mode interleaved or an idle machine"
            )
        )
    differences = DIFFERENCES + [MODE_NOTE[mode]]
    print("What differs:")
    for d in differences:
        print(f"  - {d}")
    if args.output:
        import importlib.metadata as md

        versions = {}
        for pkg in ("torch", "transformers", "megatron-core", "trl", "accelerate"):
            try:
                versions[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                versions[pkg] = None
        result = {
            "settings": {
                "prompts": P,
                "group_size": G,
                "sequences_per_step": P * G,
                "mini_batches": M,
                "max_new_tokens": cfg.rollout.max_new_tokens,
                "warmup": args.warmup,
                "steps": args.steps,
                "clip": [cfg.gspo.clip_low, cfg.gspo.clip_high],
                "lr": cfg.optimizer.lr,
                "config": os.path.relpath(args.config, REPO),
                "torch_threads": torch.get_num_threads(),
            },
            "environment": {
                "python": platform.python_version(),
                "cpu_count": os.cpu_count(),
                "load_avg_1min_start_end": [load0, os.getloadavg()[0]],
                **versions,
            },
            "ours": {**(ours.summary() if ours else {}), "per_step": ours.__dict__ if ours else None},
            "trl": {**(trl.summary() if trl else {}), "per_step": trl.__dict__ if trl else None},
            "ratio_tokens_per_s": (
                ours.summary()["tokens_per_s"] / trl.summary()["tokens_per_s"] if ours and trl else None
            ),
            "ratio_tokens_per_s_median": (
                ours.summary()["tokens_per_s_median"] / trl.summary()["tokens_per_s_median"] if ours and trl else None
            ),
            "mode": mode,
            "differences": differences,
            "table": table,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\nwrote {args.output}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
