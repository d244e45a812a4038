"""gspo-train: GSPO on Megatron-Core, one command.

    gspo-train --config configs/demo_cpu.yaml [dotted.key=value ...]
    torchrun --nproc-per-node 8 -m gspo_megatron.train --config configs/qwen3_30b_a3b_gspo.yaml
    gspo-train --config X --check                      # check the config, files, data, reward; exit
    gspo-train --config X --dry-run --nodes 2 --gpus-per-node 8 --gpu-memory-gb 80   # plan only

The loop, per step: rollout (rank 0: prompts -> G responses -> rewards -> advantages) -> every rank
gets the batch -> old log-probs recomputed by the trainer -> one optimizer step per mini-batch ->
new weights pushed to the engine -> metrics -> checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch.distributed as dist

from gspo_megatron.config import Config, config_help, load_config, save_config
from gspo_megatron.runtime.distributed import any_rank, broadcast_object


class _Stop:
    """Set by SIGTERM / SIGUSR1 (Slurm preemption): checkpoint at the end of the step, then exit."""

    signum: int | None = None

    @classmethod
    def install(cls) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, cls._handle)

    @classmethod
    def _handle(cls, signum, frame) -> None:
        cls.signum = signum


def check_before_start(cfg: Config) -> None:
    """Every start-up check of the user's input (config, output_dir, model files, tokenizer, data,
    reward, checkpoints; see gspo_megatron/preflight.py): fails in seconds, before any model is
    built, with one line naming the field or file:line. Raises errors.UserInputError."""
    from gspo_megatron import preflight

    preflight.run_all(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))


def train(cfg: Config, *, checked: bool = False) -> dict:
    """Run (or resume) a training job. Every rank calls it. Returns the last step's metrics.
    ``checked``: the caller already ran :func:`check_before_start` (main() does)."""
    from gspo_megatron import factory
    from gspo_megatron.checkpoint import load_checkpoint, save_checkpoint
    from gspo_megatron.models.build import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.offload import TrainStateOffloader
    from gspo_megatron.optim import OptimOptions, setup_training
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.train_step import train_on_batch
    from gspo_megatron.weight_sync.sync import WeightSyncer

    if not checked:
        check_before_start(cfg)
    p = cfg.parallel
    init_distributed(ParallelLayout(p.tp, p.pp, p.ep, p.etp, p.cp, bool(p.sequence_parallel)), seed=cfg.seed)
    rank = dist.get_rank()
    _Stop.install()
    os.makedirs(cfg.output_dir, exist_ok=True)
    if rank == 0:
        save_config(cfg, os.path.join(cfg.output_dir, "config.yaml"), header=record_model_source(cfg))

    # -- model, optimizer, starting weights --------------------------------------------------------
    hf_dir = factory.hf_init_dir(cfg)
    hf = load_hf_config(hf_dir)
    model = factory.build_model(cfg, hf)
    steps_total = cfg.train.steps * cfg.gspo.mini_batches
    o = cfg.optimizer
    ddp, optimizer, scheduler = setup_training(model, OptimOptions(
        lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
        lr_warmup_steps=o.lr_warmup_steps, lr_decay_style=o.lr_decay_style, total_steps=steps_total,
        use_distributed_optimizer=p.use_distributed_optimizer,
        grad_reduce_in_fp32=p.grad_reduce_in_fp32,
        cpu_offload_fraction=o.cpu_offload_fraction))
    ckpt_root = os.path.join(cfg.output_dir, "checkpoints")
    # resume: the newest loadable checkpoint (a corrupt newest one falls back to the previous)
    resume_from = cfg.checkpoint.load or ckpt_root
    start_step, extra = 0, {}
    loaded = load_checkpoint(resume_from, model, optimizer, scheduler) if os.path.isdir(resume_from) else None
    if loaded is not None:
        start_step, extra = loaded[0], loaded[1] or {}
        if rank == 0:
            print(f"[gspo-train] resuming from step {start_step} (checkpoint in {os.path.abspath(resume_from)}); "
                  f"training steps {start_step + 1}..{cfg.train.steps}", flush=True)
    elif cfg.model.checkpoint:
        if load_checkpoint(cfg.model.checkpoint, model, restore_rng=False) is None:
            raise FileNotFoundError(f"model.checkpoint {cfg.model.checkpoint!r} holds no checkpoint")
        optimizer.reload_model_params()
    else:
        load_hf_weights(model, hf_dir)
    ref_model = None
    if cfg.gspo.kl_coef > 0:  # a frozen copy of the starting policy
        ref_model = factory.build_model(cfg, hf)
        load_hf_weights(ref_model, hf_dir) if not cfg.model.checkpoint else load_checkpoint(
            cfg.model.checkpoint, ref_model, restore_rng=False)
        ref_model.requires_grad_(False)

    # -- every rank: the tokenizer; rank 0: data, rewards, metrics ---------------------------------------
    tokenizer = factory.build_tokenizer(hf_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    dataset = sampler = rewards = logger = None
    if rank == 0:
        from gspo_megatron.data.dataset import PromptSampler
        from gspo_megatron.metrics import MetricsLogger

        dataset = factory.build_dataset(cfg, tokenizer)
        sampler = PromptSampler(len(dataset), seed=cfg.seed, shuffle=cfg.data.shuffle)
        if "sampler" in extra:
            sampler.load_state_dict(extra["sampler"])
        rewards = factory.build_rewards(cfg)
        logger = MetricsLogger(cfg.output_dir, rank=rank, resume_step=start_step if loaded is not None else None,
                               total_steps=cfg.train.steps, tensorboard=cfg.logging.tensorboard,
                               console="auto" if cfg.logging.progress else "plain",
                               console_every=cfg.train.log_interval,
                               wandb_project=cfg.logging.wandb_project, config=cfg.to_dict())
    # -- every rank: the engines (colocated ones start on the nodes that share their GPUs) and this
    #    rank's part of the weight sync
    rollout = factory.build_rollout(cfg, hf_dir)
    engine = rollout.engine
    syncer = WeightSyncer(model, rollout.topology, cfg.rollout.sync_bucket_mb)

    # -- the loop ------------------------------------------------------------------------------------
    from gspo_megatron.rollout.session import RolloutSession
    from gspo_megatron.rollout_step import collect_rollouts
    from gspo_megatron.runtime.gpu_monitor import GpuMonitor
    from gspo_megatron.weight_sync.probe import default_tolerance

    verify = None
    if cfg.rollout.sync_verify:
        verify = (model, cfg.rollout.sync_verify_tol or default_tolerance(cfg.model.dtype), pad_id)
    session = RolloutSession(
        syncer, engine, sampler, max_restarts=cfg.rollout.max_engine_restarts,
        colocated=cfg.rollout.sync_mode == "colocated", kv_cache_after_sync=not cfg.rollout.offload_train,
        collect=lambda step: collect_rollouts(cfg, step, engine, dataset, sampler, tokenizer, rewards),
        dead_engines=rollout.dead_engines, restart=rollout.restart, verify=verify,
        probe_prompts=[dataset[i].prompt_ids for i in range(min(4, len(dataset)))] if rank == 0 else None)
    from gspo_megatron.rollout.async_producer import attach_overlap

    # rollout.max_staleness >= 1: rank 0 generates the next batches while every rank trains
    overlap = attach_overlap(cfg, session, model, start_step)
    session.sync()  # the engines start from exactly the trainer's weights
    gpu_monitor = GpuMonitor()  # a quiet no-op without a GPU
    metrics: dict = {}
    bad_streak = int(extra.get("bad_streak", 0))
    step, stopped = start_step, False
    # rollout.offload_train: params, grads and optimizer states leave the device while the engines generate
    offloader = TrainStateOffloader(ddp, optimizer) if cfg.rollout.offload_train else None
    if offloader is not None:  # a re-sync inside the rollout (engine restarted) needs the weights back
        session.sync = offloader.loaded_call(session.sync)
    from gspo_megatron.evaluation import Evaluator  # eval.*: step 0, every eval.interval, the last step

    evaluator = Evaluator(cfg, tokenizer, engine, rewards, last_step=int(extra.get("eval_last_step", -1)))
    if evaluator.due(start_step):  # (a resume evaluates its start step only if that was not done)
        eval_metrics = evaluator.run(session, start_step, offloader)
        if rank == 0:
            logger.log(start_step, eval_metrics)
    for step in range(start_step + 1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        if offloader is not None:  # (after the previous step's sync and checkpoint)
            offloader.offload()
            dist.barrier()  # every rank's state is off its GPU before the engines take their KV cache back
            session.resume_kv_cache()
        records, rollout_metrics = session.rollout(step)
        session.release_engines()  # colocated: the engines' weights and KV cache leave the GPUs
        if offloader is not None:  # back before training, once rank 0 has released the engines' memory
            dist.barrier()
            offloader.reload()
        metrics = train_on_batch(cfg, ddp, optimizer, scheduler, records, pad_id, ref_model=ref_model,
                                 behaviour=overlap.history if overlap is not None else None)
        sync_metrics = session.sync()  # (colocated: takes the engines' memory back around the sync)
        bad_streak = bad_streak + 1 if metrics.pop("_nonfinite_step") else 0
        step_time = time.perf_counter() - t0
        n_tokens = sum(len(r["tokens"]) for r in records)
        metrics.update(sync_metrics)
        metrics.update(offloader.metrics() if offloader is not None else {})
        metrics.update(gpu_monitor.sample())
        metrics.update({"step": step, "perf/step_time_s": step_time, "perf/tokens_per_s": n_tokens / step_time,
                        "train/bad_streak": float(bad_streak), "rollout/engine_restarts": float(session.restarts)})
        if evaluator.due(step):  # on this step's weights (after its sync); every rank
            metrics.update(evaluator.run(session, step, offloader))
        if rank == 0:
            metrics.update(rollout_metrics)
            served = engine.take_served()
            if served:
                metrics["rollout/engines_serving"] = float(sum(1 for n in served if n > 0))
            logger.log(step, metrics)
        stop_signal = stopped = any_rank(_Stop.signum is not None)
        too_bad = bad_streak >= cfg.optimizer.max_bad_steps > 0
        interval = cfg.checkpoint.interval
        if (interval and step % interval == 0) or step == cfg.train.steps or too_bad or \
                (stop_signal and cfg.checkpoint.save_on_signal):
            # (skipped updates leave the weights untouched: with too_bad this is the last good state)
            # (off-policy: the position after the last batch trained on; pending batches are regenerated)
            state = {"sampler": session.sampler.state_dict() if rank == 0 else None, "bad_streak": bad_streak,
                     "eval_last_step": evaluator.last_step}
            save_checkpoint(ckpt_root, step, model, optimizer, scheduler, extra_state=broadcast_object(state),
                            keep_last=cfg.checkpoint.keep_last, hf_assets_dir=hf_dir)
        if too_bad:
            raise RuntimeError(f"{bad_streak} consecutive steps had a non-finite loss or gradient norm "
                               f"(optimizer.max_bad_steps={cfg.optimizer.max_bad_steps}); stopping. "
                               f"The last good state is in {ckpt_root}")
        if stop_signal:
            if rank == 0:
                print(f"[gspo-train] signal received: checkpointed step {step}; exiting", flush=True)
            break

    # -- the end: the HF export of the final policy ---------------------------------------------------
    hf_out = os.path.join(cfg.output_dir, "hf_final")
    if not stopped:
        from gspo_megatron.convert import export_to_hf_dir

        export_to_hf_dir(model, hf, hf_out, max_shard_size=5 * 10**9,
                         bucket_bytes=int(cfg.rollout.sync_bucket_mb * (1 << 20)), assets_dir=hf_dir)
    if overlap is not None:
        overlap.close()
    rollout.shutdown()
    if rank == 0:
        logger.close()
        rewards.close()
        print(f"[gspo-train] run dir: {os.path.abspath(cfg.output_dir)}", flush=True)
        if not stopped:
            print(f"[gspo-train] exported Hugging Face model: {os.path.abspath(hf_out)}", flush=True)
    return metrics


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gspo-train", add_help=False,
        description="GSPO training of MoE models on Megatron-Core (CPU demo by default).",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (default: built-in CPU demo settings)")
    parser.add_argument("--check", action="store_true",
                        help="check the config, model files, tokenizer, data, reward function and checkpoints; exit")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    parser.add_argument("--dry-run", action="store_true", help="plan the layout and memory for a cluster, and exit")
    parser.add_argument("-h", "--help", action="store_true", help="show this help and every config field")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.steps=10")
    from gspo_megatron.planner import add_cluster_args

    add_cluster_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from gspo_megatron.runtime import children

    children.die_with_launcher()  # a rank never outlives a SIGKILLed torchrun agent
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.help:
        parser.print_help()
        print()
        print(config_help())
        return 0
    if args.dry_run:
        from gspo_megatron.planner import run_plan

        return run_plan(args.config, args.overrides, args.nodes, args.gpus_per_node, args.gpu_memory_gb,
                        prog="gspo-train")
    from gspo_megatron.errors import UserInputError, agree, stop_all

    error = None
    try:
        cfg = load_config(args.config, args.overrides)
        check_before_start(cfg)
    except (UserInputError, FileNotFoundError, ValueError) as e:  # nothing started yet
        error = e
    error = agree(error)  # under torchrun: every rank learns whether any rank's checks failed
    if error is not None:
        return stop_all("gspo-train", error, args.debug)
    if args.check:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"config OK: {args.config or '(defaults)'} (config, output_dir, model, tokenizer, data, "
                  "reward function, checkpoints)")
        return 0
    from gspo_megatron.runtime.distributed import destroy_distributed

    try:
        train(cfg, checked=True)
    except UserInputError as e:  # met during the run on every rank (e.g. a reward failing on every call)
        e._gspo_agreed = True  # raised on every rank together (RolloutSession broadcasts it)
        return stop_all("gspo-train", e, args.debug)
    if dist.is_initialized():
        destroy_distributed()
    return 0


def record_model_source(cfg: Config) -> str:
    """Where the model came from, for the saved config.yaml: model.arch is cleared (set to null) when
    model.hf_path's config.json defines the model, since then the arch table is not used.
    Returns a one-line description (the planner's)."""
    from gspo_megatron.models.arch import model_hf_config

    _, where = model_hf_config(cfg)
    if cfg.model.hf_path and os.path.isfile(os.path.join(cfg.model.hf_path, "config.json")):
        cfg.model.arch = None
    weights = {"pretrained": f"weights from {cfg.model.hf_path}", "random": f"random weights (seed {cfg.seed})"}
    start = f"; starting weights from model.checkpoint {cfg.model.checkpoint}" if cfg.model.checkpoint else ""
    return f"model: architecture from {where}, {weights[cfg.model.init]}{start}"


if __name__ == "__main__":
    sys.exit(main())
