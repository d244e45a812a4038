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
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch

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


@dataclass
class Side:
    """Per-measured-step numbers of one implementation (lists are aligned by step)."""

    name: str
    step_s: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    rollout_s: list[float] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)
    old_logprob_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    sync_s: list[float] = field(default_factory=list)
    reward_mean: list[float] = field(default_factory=list)
    response_len: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        """tokens_per_s: all measured tokens / all measured step time; tokens_per_s_median: the median
        step's; phases: medians over the measured steps (robust to a busy shared machine)."""

        def med(xs):
            return statistics.median(xs) if xs else None

        total_t = sum(self.step_s)
        return {
            "tokens_per_s": sum(self.tokens) / total_t if total_t > 0 else None,
            "tokens_per_s_median": med([n / t for n, t in zip(self.tokens, self.step_s)]),
            "step_time_s": med(self.step_s),
            "tokens_per_step": med(self.tokens),
            "rollout_s": med(self.rollout_s),
            "generate_s": med(self.generate_s),
            "old_logprob_s": med(self.old_logprob_s),
            "train_s": med(self.train_s),
            "sync_s": med(self.sync_s),
            "reward_mean": statistics.fmean(self.reward_mean) if self.reward_mean else None,
            "response_len_mean": statistics.fmean(self.response_len) if self.response_len else None,
            "process_wall_s": self.wall_s,
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

        from gspo_megatron.rollout.batch import collect_rollouts
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


# ------------------------------------------------------------------------------------------- TRL
def run_trl(args, cfg, hf_dir: str, prompts_by_step: list[list], workdir: str, setup_other=None):
    """TRL's GRPOTrainer (GSPO settings) on the same model, prompts and settings, in this process.
    ``setup_other()`` (optional) builds an object with ``step(measured)`` run after each TRL step.
    Returns (TRL's Side, that object or None)."""
    try:
        import datasets
        import transformers
        from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        raise SystemExit(
            f"bench/train_step.py needs TRL for the baseline ({e}); install it with `pip install trl`"
        ) from e
    from gspo_megatron.data.tasks import TASKS
    from gspo_megatron.data.tokenizer import load_tokenizer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    datasets.disable_progress_bars()
    P, G, M = cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.gspo.mini_batches
    tokenizer = load_tokenizer(hf_dir)
    eos_ids = {tokenizer.eos_token_id}
    reward_fn = TASKS[cfg.reward.function].reward

    def last_digit_reward(prompts, completions, completion_ids, label, **kwargs) -> list[float]:
        """TRL signature -> the task reward on the response decoded as ours (decode_response)."""
        out = []
        for prompt, ids, lab in zip(prompts, completion_ids, label):
            ids = ids[:-1] if ids and ids[-1] in eos_ids else ids
            text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            out.append(float(reward_fn(prompt[-1]["content"], text, lab)))
        return out

    records = [
        {"prompt": [{"role": "user", "content": row.prompt}], "label": row.label}
        for step in prompts_by_step
        for row in step
    ]
    train_dataset = datasets.Dataset.from_list(records)

    r, o, g = cfg.rollout, cfg.optimizer, cfg.gspo
    targs = GRPOConfig(
        output_dir=os.path.join(workdir, "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=cfg.seed,
        activation_checkpointing=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=P * G // M,
        gradient_accumulation_steps=1,
        steps_per_generation=M,
        num_iterations=1,
        num_generations=G,
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=max(r.top_k, 0),
        learning_rate=o.lr,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_epsilon=o.adam_eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.clip_grad,
        lr_scheduler_type="constant",
        warmup_steps=0,
        beta=0.0,
        epsilon=g.clip_low,
        epsilon_high=g.clip_high,
        importance_sampling_level="sequence",
        loss_type="grpo",
        entropy_coef=g.entropy_coef,
        scale_rewards="group" if g.std_normalize else "none",
        router_aux_loss_coef=cfg.model.moe_aux_loss_coeff,
        max_steps=len(prompts_by_step) * M,
        shuffle_dataset=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_vllm=False,
        log_completions=False,
    )

    phases: list[dict] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """Times TRL's own phases; the computation is untouched."""

        _in_scoring = False

        def _generate_and_score_completions(self, inputs):
            phases.append({"generate_s": 0.0, "old_logprob_s": 0.0, "tokens": 0, "prompt_ids": []})
            t0 = time.perf_counter()
            self._in_scoring = True
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self._in_scoring = False
            phases[-1]["scoring_s"] = time.perf_counter() - t0
            return out

        def _generate(self, prompts):
            out = super()._generate(prompts)
            prompt_ids, completion_ids = out[0], out[1]
            phases[-1]["tokens"] += sum(len(p) for p in prompt_ids) + sum(len(c) for c in completion_ids)
            phases[-1]["prompt_ids"] = [tuple(p) for p in prompt_ids]
            phases[-1]["response_len"] = sum(len(c) for c in completion_ids) / len(completion_ids)
            phases[-1]["reward_mean"] = None
            return out

        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **kw)
            phases[-1]["generate_s"] += time.perf_counter() - t0
            return out

        def _calculate_rewards(self, inputs, *a, **kw):
            out = super()._calculate_rewards(inputs, *a, **kw)
            phases[-1]["reward_mean"] = float(out.sum(dim=1).mean())
            return out

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            t0 = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*a, **kw)
            if self._in_scoring:
                phases[-1]["old_logprob_s"] += time.perf_counter() - t0
            return out

    class StepClock(TrainerCallback):
        """TRL's time per rollout step (M optimizer steps); after each, runs ``other``'s step (if
        any), whose time is excluded."""

        def __init__(self):
            self.step_s: list[float] = []
            self.acc = self.last = self.excluded = 0.0

        def on_train_begin(self, *a, **kw):
            self.last = time.perf_counter()

        def on_step_end(self, args_, state, control, **kw):
            now = time.perf_counter()
            self.acc += now - self.last
            self.last = now
            if state.global_step % M == 0:
                self.step_s.append(self.acc)
                self.acc = 0.0
                if other is not None:
                    other.step(measured=len(self.step_s) > args.warmup)
                    self.last = time.perf_counter()
                    self.excluded += self.last - now

    t_start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    clock = StepClock()
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=last_digit_reward,
        args=targs,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # its end-of-training dict would clutter the table
    # built after TRL's trainer: accelerate's process state must not see our world-of-one process group
    t_other = time.perf_counter()
    other = setup_other() if setup_other is not None else None
    clock.excluded += time.perf_counter() - t_other
    trainer.train()
    wall = time.perf_counter() - t_start - clock.excluded

    steps = len(prompts_by_step)
    if len(phases) != steps or len(clock.step_s) != steps:
        raise RuntimeError(f"TRL ran {len(phases)} generations / {len(clock.step_s)} rollout steps, expected {steps}")
    side = Side("TRL GRPOTrainer (GSPO)", wall_s=wall)
    for k in range(steps):
        ph = phases[k]
        ours_ids = sorted(tuple(row.prompt_ids) for row in prompts_by_step[k] for _ in range(G))
        if sorted(ph["prompt_ids"]) != ours_ids:  # the fairness premise: identical prompt tokens
            raise RuntimeError(f"step {k + 1}: TRL's prompt token ids differ from gspo-megatron's")
        if k < args.warmup:
            continue
        step_s = clock.step_s[k]
        side.step_s.append(step_s)
        side.tokens.append(float(ph["tokens"]))
        side.generate_s.append(ph["generate_s"])
        side.rollout_s.append(ph["scoring_s"] - ph["old_logprob_s"])
        side.old_logprob_s.append(ph["old_logprob_s"])
        side.train_s.append(step_s - ph["scoring_s"])
        side.reward_mean.append(ph["reward_mean"])
        side.response_len.append(ph["response_len"])
    return side, other


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
