"""TRL's side of ``bench/train_step.py`` (the GSPO step against TRL's GRPOTrainer; its docstring says
what is compared and how), and the per-step numbers both sides fill (:class:`Side`)."""

from __future__ import annotations

import os
import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch


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
