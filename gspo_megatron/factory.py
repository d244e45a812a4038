"""Build a run's components from the config: the HF starting point, tokenizer, dataset, rewards,
rollout engine and the Megatron model. Called by ``train.py``; which ranks call what is noted on
each function.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gspo_megatron.config import Config, values_for
from gspo_megatron.dtypes import torch_dtype
from gspo_megatron.features.adapter_sync import ADAPTER_SYNC
from gspo_megatron.features.routing_replay import ROUTING_REPLAY
from gspo_megatron.runtime import distributed as rdist


def hf_init_dir(cfg: Config) -> str:
    """The HF directory the run starts from (config.json + weights + tokenizer).

    model.init=pretrained: model.hf_path itself. model.init=random: rank 0 writes
    ``output_dir/hf_init`` once (random weights from transformers' own init under ``seed``, the demo
    tokenizer when model.hf_path has none) and every rank then reads it, so trainer and engine start
    from identical weights. All ranks call this (it has a barrier)."""
    if cfg.model.init == "pretrained":
        if not cfg.model.hf_path:
            raise ValueError("model.init=pretrained needs model.hf_path (an HF directory)")
        return cfg.model.hf_path
    out = os.path.join(cfg.output_dir, "hf_init")
    if rdist.rank() == 0 and not os.path.exists(os.path.join(out, "model.safetensors")):
        _write_random_hf_model(cfg, out)
    rdist.barrier()
    return out


def _write_random_hf_model(cfg: Config, out: str) -> None:
    from gspo_megatron.data.tokenizer import build_demo_tokenizer
    from gspo_megatron.models.arch import model_hf_config
    from gspo_megatron.models.tiny import hf_model_from_config

    hf, _ = model_hf_config(cfg)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = hf_model_from_config(hf, torch_dtype(cfg.model.dtype))
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a "Writing model shards" bar for one small shard
    try:
        model.save_pretrained(tmp)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    tok_src = cfg.model.hf_path
    if tok_src and os.path.exists(os.path.join(tok_src, "tokenizer_config.json")):
        for name in os.listdir(tok_src):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                shutil.copy(os.path.join(tok_src, name), tmp)
    else:
        build_demo_tokenizer(tmp)
    # config.json stays as transformers wrote it (5.x spellings such as num_local_experts and
    # rope_parameters): every reader goes through gspo_megatron.models.hf_config.
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def build_tokenizer(hf_dir: str):
    """Every rank: the tokenizer saved with the starting model (AutoTokenizer)."""
    from gspo_megatron.data.tokenizer import load_tokenizer

    return load_tokenizer(hf_dir)


def build_dataset(cfg: Config, tokenizer):
    """Rank 0: the prompt dataset (a file, or rows of a built-in task)."""
    from gspo_megatron.data.dataset import PromptDataset
    from gspo_megatron.data.tasks import get_task

    common: dict[str, Any] = dict(
        prompt_key=cfg.data.prompt_key,
        label_key=cfg.data.label_key,
        max_prompt_tokens=cfg.data.max_prompt_len,
        use_chat_template=cfg.data.apply_chat_template,
        skip_bad_rows=cfg.data.skip_bad_rows,
    )
    if cfg.distill.teacher_key:  # each row names its teacher (features/distill.py)
        from gspo_megatron.features.distill import parse_teachers

        names = tuple(t.name for t in parse_teachers(cfg.distill.teachers)[0])
        common["teacher_route"] = (cfg.distill.teacher_key, names)
    if cfg.data.path:
        return PromptDataset.from_file(cfg.data.path, tokenizer, **common)
    assert cfg.data.task is not None, "config validation: data.path or data.task is set"
    task = get_task(cfg.data.task)
    return PromptDataset.from_records(task.rows(4096, cfg.seed), tokenizer, source=f"task {task.name}", **common)


def build_rewards(cfg: Config):
    """Rank 0: the reward scorer: the server at reward.url (batched POSTs, rewards/remote.py), or
    reward.function in a process pool with timeouts (reward.num_workers > 0) or inline; per sample,
    or per group with reward.group. ``score(prompts, responses, labels, group_size)``."""
    from gspo_megatron.rewards.runner import InlineRewardScorer, RewardRunner

    r = cfg.reward
    if r.url:
        from gspo_megatron.rewards.remote import RemoteRewardScorer

        return RemoteRewardScorer(
            r.url,
            timeout_s=r.timeout_s,
            batch_size=r.batch_size,
            max_in_flight=r.max_in_flight,
            retries=r.retries,
            group=r.group,
            max_failure_share=r.max_failure_share,
        )
    if r.num_workers > 0:
        return RewardRunner(
            r.function,
            num_workers=r.num_workers,
            timeout_s=r.timeout_s,
            max_failure_share=r.max_failure_share,
            group=r.group,
        )
    return InlineRewardScorer(r.function, max_failure_share=r.max_failure_share, group=r.group)


@dataclass
class Engines:
    """The run's engines as this rank sees them. engine: what rank 0 generates with (None on other
    ranks); topology: this rank's part of the weight sync; dead_engines() (rank 0) and restart(dead)
    (collective) serve ``RolloutSession``; shutdown() on every rank stops what this rank started."""

    engine: Any
    topology: Any
    dead_engines: Callable[[], list[int]]
    restart: Callable[[list[int]], None]
    shutdown: Callable[[], None]


def start_engines(cfg: Config, hf_dir: str):
    """Every rank: launch the SGLang engine fleet (``fleet.engine_fleet.EngineFleet``; nothing waits
    for it yet) when ``rollout.engine=sglang``, else None. ``train.build_trainer`` calls it before the
    model is built when the engines have GPUs of their own (disaggregated, launched here or attached
    by URL), so that their start-up overlaps the model build and the checkpoint load; colocated
    engines start after the trainer's model holds its memory (:func:`build_engines`)."""
    if cfg.rollout.engine != "sglang":
        return None
    from gspo_megatron.fleet.engine_args import config_server_args
    from gspo_megatron.fleet.engine_fleet import EngineFleet
    from gspo_megatron.models.hf_config import load_hf_config

    hf = load_hf_config(hf_dir)  # read once: the flags below and the fleet's check of attached engines
    route_spec = None
    if ROUTING_REPLAY.returns_routes(cfg):  # the engines return each token's routed experts (engines/routing.py)
        from gspo_megatron.engines.routing import route_spec_of

        route_spec = route_spec_of(hf)
    # every flag the config needs (each enabled component's: features/): fleet/engine_args.py
    server_args = config_server_args(cfg, hf, route_spec)
    return EngineFleet(
        cfg,
        hf_dir,
        hf=hf,
        server_args=server_args,
        log_dir=os.path.join(cfg.output_dir, "engine_logs"),
        route_spec=route_spec,
    )


def build_engines(cfg: Config, hf_dir: str, started=None) -> Engines:
    """Every rank: the rollout engines and the weight-sync topology (weights arrive through the
    first sync, not from files).

    - ``rollout.engine=hf``: the transformers engine on rank 0 (in a child process with
      ``rollout.engine_process``), fed in-process.
    - ``rollout.engine=sglang``: ``rollout.num_engines`` SGLang servers (``rollout.engine_server``:
      the real one, or the CPU stand-in) placed and launched by ``fleet.engine_fleet``, or attached
      by URL; colocated or disaggregated sync (``weight_sync.topology``). ``started``: the fleet
      :func:`start_engines` launched earlier (else it is launched now); this waits until it answers."""
    from gspo_megatron.weight_sync.topology import build_sync_topology

    rank = rdist.rank()
    if cfg.rollout.engine == "hf":
        engine = _build_hf_engine(cfg, hf_dir) if rank == 0 else None

        def dead_engines() -> list[int]:
            assert engine is not None, "dead_engines() is asked on rank 0 only"
            return [] if engine.health_check() else [0]

        return Engines(
            engine,
            build_sync_topology(cfg, engine=engine),
            dead_engines=dead_engines,
            restart=lambda dead: engine.restart() if engine is not None else None,
            shutdown=lambda: engine.shutdown() if engine is not None else None,
        )
    fleet = (started or start_engines(cfg, hf_dir)).ready()
    topology = build_sync_topology(cfg, fleet=fleet)
    if ADAPTER_SYNC.enabled(cfg) and fleet.engine is not None:  # colocated: the base stays (it is sent once)
        fleet.engine.memory_tags = ["kv_cache"]

    def restart(dead: list[int]) -> None:
        fleet.restart(dead)
        topology.reconnect_all()

    return Engines(fleet.engine, topology, dead_engines=fleet.dead_engines, restart=restart, shutdown=fleet.shutdown)


def _build_hf_engine(cfg: Config, hf_dir: str):
    from gspo_megatron.engines.hf_engine import HFRolloutEngine

    kwargs: dict[str, Any] = dict(config=hf_dir, weights=None, dtype=torch_dtype(cfg.model.dtype), seed=cfg.seed)
    if cfg.rollout.engine_process:
        from gspo_megatron.engines.subprocess_engine import SubprocessRolloutEngine

        return SubprocessRolloutEngine(HFRolloutEngine, kwargs, call_timeout_s=cfg.rollout.engine_timeout_s)
    return HFRolloutEngine(**kwargs)


def build_model(cfg: Config, hf: dict):
    """Every rank: this rank's Megatron model chunk for the configured layout."""
    from gspo_megatron.models.build import ModelOptions
    from gspo_megatron.models.build import build_model as _build

    p = cfg.parallel
    fp8_fields = None
    if cfg.model.fp8:
        from gspo_megatron.runtime.fp8 import FP8Options, check_fp8_runtime

        fp8 = FP8Options.from_mapping({"fp8": cfg.model.fp8, "recipe": cfg.model.fp8_recipe}, prefix="model")
        check_fp8_runtime(fp8)
        fp8_fields = fp8.transformer_config_kwargs(is_moe=True, token_dispatcher=cfg.model.moe_token_dispatcher)
    # model.* and parallel.sequence_parallel by name (config.values_for); perform_initialization True
    # even though the weights are loaded right after: Megatron sets the tensor-parallel attributes of
    # its parameters (used by the grad norm / clipping to skip TP duplicates) only inside its init
    # functions; without them a TP>1 grad norm misses every shard but rank 0's.
    lora = cfg.model.lora
    lora_opts = None
    if lora.rank > 0:  # adapters on the local spec's linears, the rest frozen (models/lora.py)
        from gspo_megatron.models.lora import LoraOptions

        lora_opts = LoraOptions(
            rank=lora.rank,
            alpha=lora.alpha,
            dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            seed=cfg.seed,
        )
    opts = ModelOptions(
        **values_for(
            ModelOptions,
            cfg.model,
            cfg.parallel,
            fp8_fields=fp8_fields,
            perform_initialization=True,
            lora=lora_opts,
            mtp=cfg.mtp_in_model,  # model.mtp (null: with rollout.speculative)
        )
    )
    return _build(hf, p.tp, p.pp, p.ep, p.etp, p.cp, opts)
