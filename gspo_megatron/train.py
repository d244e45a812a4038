"""gspo-train: GSPO on Megatron-Core, one command.

    gspo-train --config configs/demo_cpu.yaml [dotted.key=value ...]
    torchrun --nproc-per-node 8 -m gspo_megatron.train --config configs/qwen3_30b_a3b_gspo.yaml
    gspo-train --config X --check                      # check the config, files, data, reward; exit
    gspo-train --config X --dry-run --nodes 2 --gpus-per-node 8 --gpu-memory-gb 80   # plan only

``train()`` reads top to bottom: build the trainer (disaggregated engines are launched first, so that
their start-up overlaps the model build and the checkpoint load) -> resume (starting weights and
step) -> build the rollout side -> one ``run_step`` per step -> finish (HF export). A step: rollout
(rank 0: prompts -> G responses -> rewards -> advantages) -> every rank gets the batch -> old
log-probs recomputed by the trainer -> one optimizer step per mini-batch -> new weights pushed to the
engines -> metrics -> checkpoint. docs/architecture.md has the dataflow and where each part lives.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from gspo_megatron.config import Config, config_help, load_config, save_config, values_for
from gspo_megatron.runtime import stop
from gspo_megatron.runtime.distributed import any_rank, broadcast_object
from gspo_megatron.sample import Sample

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from transformers import PreTrainedTokenizerBase

    from gspo_megatron.data.dataset import PromptDataset, PromptSampler
    from gspo_megatron.distill.teachers import TeacherPool
    from gspo_megatron.evaluation import Evaluator
    from gspo_megatron.factory import Engines
    from gspo_megatron.fleet.engine_fleet import EngineFleet
    from gspo_megatron.metrics import MetricsLogger
    from gspo_megatron.orchestration.async_producer import Overlap
    from gspo_megatron.orchestration.session import RolloutSession
    from gspo_megatron.rewards.remote import RemoteRewardScorer
    from gspo_megatron.rewards.runner import InlineRewardScorer, RewardRunner
    from gspo_megatron.runtime.gpu_monitor import GpuMonitor
    from gspo_megatron.trainer.offload import TrainStateOffloader

    RewardScorer = InlineRewardScorer | RewardRunner | RemoteRewardScorer  # factory.build_rewards


def check_before_start(cfg: Config) -> None:
    """Every start-up check of the user's input (config, output_dir, model files, tokenizer, data,
    reward, checkpoints; see gspo_megatron/preflight.py): fails in seconds, before any model is
    built, with one line naming the field or file:line. Raises errors.UserInputError."""
    from gspo_megatron import preflight

    preflight.run_all(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))


def train(cfg: Config, *, checked: bool = False, after_sync: Callable[[Any], None] | None = None) -> dict:
    """Run (or resume) a training job. Every rank calls it. Returns the last step's metrics.
    ``checked``: the caller already ran :func:`check_before_start` (main() does). ``after_sync``:
    test instrumentation, ``after_sync(syncer)`` on every rank after each successful weight sync
    (``RolloutSession``'s argument; no config key or CLI flag sets it)."""
    if not checked:
        check_before_start(cfg)
    run = build_trainer(cfg)  # process groups, run dir, disaggregated engines launched, model, optimizer
    try:
        resume(cfg, run)  # the starting weights and step: a checkpoint, model.checkpoint or model.hf_path
        build_rollout_side(cfg, run, after_sync=after_sync)  # data, rewards, metrics, engines, session; first sync
        stopped = False
        for step in range(run.start_step + 1, cfg.train.steps + 1):
            stopped = run_step(cfg, run, step)
            if stopped:
                break
    except stop.Stopped:  # a stop signal while an engine started (runtime/stop.py)
        close(run)
        raise
    except BaseException:
        if run.rollout is None:  # failed before the engines were ready: stop the ones launched early
            close(run)
        raise
    finish(cfg, run, stopped)
    return run.metrics


@dataclass
class Run:
    """Everything one training job holds; built by :func:`build_trainer` / :func:`build_rollout_side`,
    filled by :func:`resume`, advanced by :func:`run_step`. Fields marked rank 0 are None elsewhere."""

    rank: int
    hf_dir: str
    hf: dict
    model: GPTModel  # this rank's chunk (its pipeline stage, its experts)
    ddp: DistributedDataParallel
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    ckpt_root: str
    ref_model: GPTModel | None = None  # gspo.kl_coef > 0
    start_step: int = 0
    resumed: bool = False
    extra: dict = field(default_factory=dict)  # trainer state saved with the checkpoint
    bad_streak: int = 0  # consecutive steps with a skipped (non-finite) update
    tokenizer: PreTrainedTokenizerBase | None = None
    pad_id: int = 0
    dataset: PromptDataset | None = None  # rank 0
    sampler: PromptSampler | None = None  # rank 0
    rewards: RewardScorer | None = None  # rank 0
    logger: MetricsLogger | None = None  # rank 0
    engines_starting: EngineFleet | None = None  # launched by build_trainer, until build_rollout_side waits
    rollout: Engines | None = None  # the engines and this rank's sync topology
    session: RolloutSession | None = None
    offloader: TrainStateOffloader | None = None  # rollout.offload_train
    gpu_monitor: GpuMonitor | None = None
    overlap: Overlap | None = None  # rollout.max_staleness >= 1
    evaluator: Evaluator | None = None  # eval.*
    teachers: TeacherPool | None = None  # rank 0, distill.teachers
    metrics: dict = field(default_factory=dict)  # the last step's


def build_trainer(cfg: Config) -> Run:
    """Every rank: process groups, the run directory (rank 0 writes config.yaml), disaggregated SGLang
    engines launched (``factory.start_engines``; they start on GPUs of their own while the model is
    built and the checkpoint loads; ``build_rollout_side`` waits for them), this rank's model (random
    init) wrapped in Megatron DDP with its optimizer and LR schedule; with ``rollout.offload_train``
    the state offloader, whose host memory starts being reserved now."""
    from gspo_megatron import factory
    from gspo_megatron.features.offload import OFFLOAD
    from gspo_megatron.features.sync_modes import sync_mode
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.trainer.offload import TrainStateOffloader
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training

    p = cfg.parallel
    init_distributed(ParallelLayout(p.tp, p.pp, p.ep, p.etp, p.cp, bool(p.sequence_parallel)), seed=cfg.seed)
    rank = dist.get_rank()
    stop.install()  # SIGTERM / SIGUSR1: checkpoint at the end of the step, then exit (runtime/stop.py)
    os.makedirs(cfg.output_dir, exist_ok=True)
    if rank == 0:
        save_config(cfg, os.path.join(cfg.output_dir, "config.yaml"), header=record_model_source(cfg))
    hf_dir = factory.hf_init_dir(cfg)
    hf = load_hf_config(hf_dir)
    early = None  # colocated engines start after the model holds its memory (build_rollout_side)
    if not sync_mode(cfg.rollout.sync_mode).colocated:
        early = factory.start_engines(cfg, hf_dir)
    try:
        model = factory.build_model(cfg, hf)
        # optimizer.* and parallel.* by name (config.values_for)
        opts = OptimOptions(
            **values_for(OptimOptions, cfg.optimizer, cfg.parallel, total_steps=cfg.train.steps * cfg.gspo.mini_batches)
        )
        ddp, optimizer, scheduler = setup_training(model, opts)
        offloader = None
        if OFFLOAD.enabled(cfg):  # its host memory is pinned while the checkpoint loads and the engines start
            offloader = TrainStateOffloader(ddp, optimizer)
            offloader.reserve()
    except BaseException:
        if early is not None:
            early.shutdown()
        raise
    return Run(
        rank=rank,
        hf_dir=hf_dir,
        hf=hf,
        model=model,
        ddp=ddp,
        optimizer=optimizer,
        scheduler=scheduler,
        ckpt_root=os.path.join(cfg.output_dir, "checkpoints"),
        offloader=offloader,
        engines_starting=early,
    )


def resume(cfg: Config, run: Run) -> None:
    """Every rank: the starting weights and step, first found of: the newest loadable checkpoint under
    checkpoint.load (else output_dir/checkpoints; a corrupt newest one falls back to the previous:
    weights, optimizer, schedule, RNG, step, trainer state), model.checkpoint (weights only), the HF
    weights of model.hf_path (or the random init written by factory.hf_init_dir). With gspo.kl_coef > 0
    also the frozen reference model, from the starting policy (never from a resumed one)."""
    from gspo_megatron import factory
    from gspo_megatron.checkpoint.manager import load_checkpoint
    from gspo_megatron.models.weights import load_hf_weights

    resume_from = cfg.checkpoint.load or run.ckpt_root
    loaded = None
    if os.path.isdir(resume_from):
        loaded = load_checkpoint(resume_from, run.model, run.optimizer, run.scheduler)
    if loaded is not None:
        run.start_step, run.extra, run.resumed = loaded[0], loaded[1] or {}, True
        run.bad_streak = int(run.extra.get("bad_streak", 0))
        if run.rank == 0:
            print(
                f"[gspo-train] resuming from step {run.start_step} (checkpoint in {os.path.abspath(resume_from)}); "
                f"training steps {run.start_step + 1}..{cfg.train.steps}",
                flush=True,
            )
    elif cfg.model.checkpoint:
        if load_checkpoint(cfg.model.checkpoint, run.model, restore_rng=False) is None:
            raise FileNotFoundError(f"model.checkpoint {cfg.model.checkpoint!r} holds no checkpoint")
        run.optimizer.reload_model_params()
    else:
        load_hf_weights(run.model, run.hf_dir)
        # bf16 / fp16: the optimizer's fp32 main params were copied from build_model's init when the
        # optimizer was made; without this the first step writes that init (+ the update) back
        run.optimizer.reload_model_params()
    if cfg.gspo.kl_coef > 0:  # a frozen copy of the starting policy
        run.ref_model = factory.build_model(cfg, run.hf)
        if cfg.model.checkpoint:
            load_checkpoint(cfg.model.checkpoint, run.ref_model, restore_rng=False)
        else:
            load_hf_weights(run.ref_model, run.hf_dir)
        run.ref_model.requires_grad_(False)


def build_rollout_side(cfg: Config, run: Run, after_sync: Callable[[Any], None] | None = None) -> None:
    """Every rank: the tokenizer, the engines (colocated ones start on the nodes that share their GPUs),
    the rollout session (``orchestration.build.build_session``), then the first sync (the engines start from exactly
    the trainer's weights), the evaluator. Rank 0 also: the dataset and its sampler (resumed), the
    reward functions, the metrics logger."""
    from gspo_megatron import factory
    from gspo_megatron.orchestration.build import build_session
    from gspo_megatron.runtime.gpu_monitor import GpuMonitor

    run.tokenizer = factory.build_tokenizer(run.hf_dir)
    run.pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else 0
    if run.rank == 0:
        from gspo_megatron.data.dataset import PromptSampler
        from gspo_megatron.metrics import MetricsLogger

        run.dataset = factory.build_dataset(cfg, run.tokenizer)
        run.sampler = PromptSampler(len(run.dataset), seed=cfg.seed, shuffle=cfg.data.shuffle)
        if "sampler" in run.extra:
            run.sampler.load_state_dict(run.extra["sampler"])
        run.rewards = factory.build_rewards(cfg)
        run.logger = MetricsLogger(
            cfg.output_dir,
            rank=run.rank,
            resume_step=run.start_step if run.resumed else None,
            total_steps=cfg.train.steps,
            tensorboard=cfg.logging.tensorboard,
            console="auto" if cfg.logging.progress else "plain",
            console_every=cfg.train.log_interval,
            wandb_project=cfg.logging.wandb_project,
            config=cfg.to_dict(),
        )
    run.rollout = rollout = factory.build_engines(cfg, run.hf_dir, started=run.engines_starting)
    run.engines_starting = None  # (now run.rollout's)
    run.teachers = _teachers(cfg, run.rank)
    run.session = session = build_session(cfg, run, after_sync=after_sync)
    session.sync()
    run.gpu_monitor = GpuMonitor()  # a quiet no-op without a GPU
    from gspo_megatron.evaluation import Evaluator  # eval.*: step 0, every eval.interval, the last step

    run.evaluator = evaluator = Evaluator(
        cfg, run.tokenizer, rollout.engine, run.rewards, last_step=int(run.extra.get("eval_last_step", -1))
    )
    if evaluator.due(run.start_step):  # (a resume evaluates its start step only if that was not done)
        eval_metrics = evaluator.run(session, run.start_step)
        if run.rank == 0:
            assert run.logger is not None  # rank 0 made it above
            run.logger.log(run.start_step, eval_metrics)


def run_step(cfg: Config, run: Run, step: int) -> bool:
    """Every rank, one step: rollout -> train -> weight sync -> metrics -> checkpoint. Returns True
    when a stop signal ended the run (after its checkpoint); raises when optimizer.max_bad_steps
    consecutive steps had a skipped update."""
    from gspo_megatron.trainer.step import train_on_batch

    t0 = time.perf_counter()
    session, evaluator = run.session, run.evaluator
    assert session is not None and evaluator is not None, "run_step needs build_rollout_side first"
    # (the session's colocation: with offload_train the state leaves the GPUs before and comes back
    # after; colocated engines release their weights and KV cache after it)
    records, rollout_metrics = session.rollout(step)
    result = train_on_batch(
        cfg,
        run.ddp,
        run.optimizer,
        run.scheduler,
        records,
        run.pad_id,
        ref_model=run.ref_model,
        behaviour=run.overlap.history if run.overlap is not None else None,
    )
    sync_metrics = session.sync()  # (colocated: takes the engines' memory back around the sync)
    run.bad_streak = run.bad_streak + 1 if result.nonfinite else 0
    step_time = time.perf_counter() - t0
    run.metrics = _step_metrics(run, step, result.metrics, sync_metrics, rollout_metrics, records, step_time)
    if evaluator.due(step):  # on this step's weights (after its sync); every rank
        run.metrics.update(evaluator.run(session, step))
    if run.rank == 0:
        assert run.logger is not None  # rank 0's
        run.logger.log(step, run.metrics)

    stop_signal = any_rank(stop.requested())
    too_bad = run.bad_streak >= cfg.optimizer.max_bad_steps > 0
    interval = cfg.checkpoint.interval
    if (
        (interval and step % interval == 0)
        or step == cfg.train.steps
        or too_bad
        or (stop_signal and cfg.checkpoint.save_on_signal)
    ):
        # (skipped updates leave the weights untouched: with too_bad this is the last good state)
        save_trainer_checkpoint(cfg, run, step)
    if too_bad:
        raise RuntimeError(
            f"{run.bad_streak} consecutive steps had a non-finite loss or gradient norm "
            f"(optimizer.max_bad_steps={cfg.optimizer.max_bad_steps}); stopping. "
            f"The last good state is in {run.ckpt_root}"
        )
    if stop_signal and run.rank == 0:
        print(f"[gspo-train] signal received: checkpointed step {step}; exiting", flush=True)
    return stop_signal


def _step_metrics(
    run: Run,
    step: int,
    train_metrics: dict,
    sync_metrics: dict,
    rollout_metrics: dict | None,
    records: list[Sample],
    step_time: float,
) -> dict:
    """One metrics.jsonl row: the training half's, the sync's, offload, GPU, timing and (rank 0) the
    rollout's metrics (``rollout_metrics``: None on the other ranks)."""
    assert run.gpu_monitor is not None and run.session is not None and run.rollout is not None, (
        "built by build_rollout_side"
    )
    metrics = dict(train_metrics)
    metrics.update(sync_metrics)
    metrics.update(run.offloader.metrics() if run.offloader is not None else {})
    metrics.update(run.gpu_monitor.sample())
    n_tokens = sum(r.length for r in records)
    metrics.update(
        {
            "step": step,
            "perf/step_time_s": step_time,
            "perf/tokens_per_s": n_tokens / step_time,
            "train/bad_streak": float(run.bad_streak),
            "rollout/engine_restarts": float(run.session.restarts),
        }
    )
    if run.rank == 0:
        assert rollout_metrics is not None  # rank 0's
        metrics.update(rollout_metrics)
        served = run.rollout.engine.take_served()
        if served:
            metrics["rollout/engines_serving"] = float(sum(1 for n in served if n > 0))
    return metrics


def save_trainer_checkpoint(cfg: Config, run: Run, step: int) -> None:
    """Every rank: the distributed checkpoint of ``step`` with the trainer state (rank 0's sampler
    position after the last batch trained on (off-policy: pending batches are regenerated), the
    bad-step streak, the last evaluated step) and the HF assets of the starting model."""
    from gspo_megatron.checkpoint.manager import save_checkpoint

    assert run.session is not None and run.evaluator is not None, "built by build_rollout_side"
    state = {
        "sampler": run.session.sampler.state_dict() if run.rank == 0 else None,
        "bad_streak": run.bad_streak,
        "eval_last_step": run.evaluator.last_step,
    }
    save_checkpoint(
        run.ckpt_root,
        step,
        run.model,
        run.optimizer,
        run.scheduler,
        extra_state=broadcast_object(state),
        keep_last=cfg.checkpoint.keep_last,
        hf_assets_dir=run.hf_dir,
    )


def finish(cfg: Config, run: Run, stopped: bool) -> None:
    """Every rank: the HF export of the final policy (not after a stop signal), the engines shut down;
    rank 0 closes the metrics and reward workers."""
    hf_out = os.path.join(cfg.output_dir, "hf_final")
    if not stopped:
        from gspo_megatron.convert import export_to_hf_dir

        export_to_hf_dir(run.model, run.hf, hf_out, max_shard_size=5 * 10**9, assets_dir=run.hf_dir)
    close(run)
    if run.rank == 0:
        print(f"[gspo-train] run dir: {os.path.abspath(cfg.output_dir)}", flush=True)
        if not stopped:
            print(f"[gspo-train] exported Hugging Face model: {os.path.abspath(hf_out)}", flush=True)


def _teachers(cfg: Config, rank: int):
    """Rank 0's distillation teachers (``distill.teachers``; None elsewhere or without them). A
    teacher that fails to start stops every rank with rank 0's one line (collective)."""
    from gspo_megatron.distill import build_teachers
    from gspo_megatron.errors import UserInputError

    pool, error = None, None
    if rank == 0:
        try:
            pool = build_teachers(cfg)
        except (UserInputError, RuntimeError) as e:
            error = str(e) if str(e).startswith("distill.") else f"distill.teachers: {e}"
    error = broadcast_object(error)
    if error is not None:
        raise UserInputError(error)
    return pool


def close(run: Run) -> None:
    """Every rank: stop what the run started, as far as it got (the engines this rank launched, the
    overlap's generator; rank 0: the metrics files and reward workers)."""
    if run.overlap is not None:
        run.overlap.close()
    if run.rollout is not None:
        run.rollout.shutdown()
    elif run.engines_starting is not None:  # launched early, never waited for
        run.engines_starting.shutdown()
    if run.logger is not None:
        run.logger.close()
    if run.rewards is not None:
        run.rewards.close()
    if run.teachers is not None:
        run.teachers.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gspo-train",
        add_help=False,
        description="GSPO training of MoE models on Megatron-Core (CPU demo by default).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML config (default: built-in CPU demo settings)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the config, model files, tokenizer, data, reward function and checkpoints; exit",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of an input error, and the known third-party warnings "
        "hidden otherwise (gspo_megatron/runtime/known_warnings.py)",
    )
    parser.add_argument("--dry-run", action="store_true", help="plan the layout and memory for a cluster, and exit")
    parser.add_argument("-h", "--help", action="store_true", help="show this help and every config field")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.steps=10")
    from gspo_megatron.plan_report import add_cluster_args

    add_cluster_args(parser)
    return parser


def main(argv: list[str] | None = None, *, after_sync: Callable[[Any], None] | None = None) -> int:
    """The ``gspo-train`` command. ``after_sync``: test instrumentation passed to :func:`train` by a
    test's launcher script (tests/topology/sync_check.py), never by the command line."""
    from gspo_megatron.runtime import children

    children.die_with_launcher()  # a rank never outlives a SIGKILLed torchrun agent
    parser = build_parser()
    args = parser.parse_args(argv)
    from gspo_megatron.runtime.known_warnings import backend_note, hide_known_warnings

    hidden = hide_known_warnings(args.debug)  # every rank, before Megatron is imported
    if args.help:
        parser.print_help()
        print()
        print(config_help())
        return 0
    if args.dry_run:
        from gspo_megatron.plan_report import run_plan

        return run_plan(
            args.config, args.overrides, args.nodes, args.gpus_per_node, args.gpu_memory_gb, prog="gspo-train"
        )
    from gspo_megatron.errors import UserInputError, agree, stop_all

    error: BaseException | None = None
    try:
        cfg = load_config(args.config, args.overrides)
        check_before_start(cfg)
    except (UserInputError, FileNotFoundError, ValueError) as e:  # nothing started yet
        error = e
    error = agree(error)  # under torchrun: every rank learns whether any rank's checks failed
    if error is not None:
        return stop_all("gspo-train", error, args.debug, together=True)
    if args.check:
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"config OK: {args.config or '(defaults)'} (config, output_dir, model, tokenizer, data, "
                "reward function, checkpoints)"
            )
        return 0
    from gspo_megatron.runtime.distributed import destroy_distributed

    note = backend_note(hidden)
    if note and int(os.environ.get("RANK", "0")) == 0:
        print(note, flush=True)
    try:
        train(cfg, checked=True, after_sync=after_sync)
    except UserInputError as e:  # met during the run on every rank (e.g. a reward failing on every call)
        return stop_all("gspo-train", e, args.debug, together=True)  # (RolloutSession broadcasts it)
    except stop.Stopped as e:  # every rank (the engine fleet's collective told them); engines stopped
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"[gspo-train] {e}: engines stopped, exiting (nothing saved now; a rerun resumes from the last checkpoint)",
                flush=True,
            )
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
