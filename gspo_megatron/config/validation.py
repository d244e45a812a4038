"""Config checks; every error names the field (``section.key``) and what is allowed.

Three levels, each run before any heavy start: :func:`_static_errors` (the config alone; run by
``load_config``), :func:`validate` (the number of training ranks), :func:`validate_model_layout` (the
model's dimensions, from its HF config.json as a dict).
"""

from __future__ import annotations

import difflib
import os

from gspo_megatron.config.schema import Config
from gspo_megatron.errors import ConfigError
from gspo_megatron.features import enabled_features, feature_config_errors
from gspo_megatron.features.sync_modes import SYNC_MODES


def _builtin_rewards() -> list[str]:
    from gspo_megatron.rewards.builtin import BUILTIN_REWARDS

    return list(BUILTIN_REWARDS)


def _policy_objective(mode: str, errors: list[str]):
    """The registered objective (losses/objectives.py) of ``gspo.mode``; None (and one line in ``errors``
    naming the registered modes) when there is none."""
    from gspo_megatron.losses.objectives import policy_objective

    try:
        return policy_objective(mode, "gspo.mode")
    except ValueError as err:
        errors.append(str(err))
        return None


def _builtin_tasks() -> list[str]:
    from gspo_megatron.data.tasks import TASKS

    return sorted(TASKS)


def _static_errors(cfg: Config, check_files: bool) -> list[str]:
    """Checks that need neither the world size nor the model dims; every message names its field."""
    e: list[str] = []

    def need(ok: object, msg: str) -> None:  # ok: any value, tested for truth
        if not ok:
            e.append(msg)

    def positive(name: str, value: float | int) -> None:
        need(value > 0, f"{name} must be > 0, got {value}")

    def non_negative(name: str, value: float | int) -> None:
        need(value >= 0, f"{name} must be >= 0, got {value}")

    def exists(name: str, path: str | None, kind: str = "path") -> None:
        if path is not None and check_files:
            ok = (
                os.path.isfile(path)
                if kind == "file"
                else os.path.isdir(path)
                if kind == "dir"
                else os.path.exists(path)
            )
            if ok:
                return
            if not os.path.exists(path):
                e.append(f"{name}: {kind} {path!r} does not exist")
            else:
                e.append(f"{name}: {path!r} is a {'directory' if os.path.isdir(path) else 'file'}, expected a {kind}")

    need(bool(cfg.output_dir), "output_dir must be a non-empty path")
    non_negative("seed", cfg.seed)

    m = cfg.model
    from gspo_megatron.models.arch import KNOWN_ARCHS

    if m.arch is not None and m.arch not in KNOWN_ARCHS:
        close = difflib.get_close_matches(m.arch, list(KNOWN_ARCHS), n=1)
        need(
            False,
            f"model.arch {m.arch!r} is not a built-in architecture"
            + (f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(KNOWN_ARCHS)}"),
        )
    need(
        m.init == "random" or m.hf_path or m.checkpoint, "model.init=pretrained needs model.hf_path or model.checkpoint"
    )
    need(m.arch or m.hf_path, "model.arch or model.hf_path must say which architecture to build")
    exists("model.hf_path", m.hf_path, "dir")
    if m.hf_path and check_files and os.path.isdir(m.hf_path):
        need(os.path.isfile(os.path.join(m.hf_path, "config.json")), f"model.hf_path: no config.json in {m.hf_path!r}")
    exists("model.checkpoint", m.checkpoint)
    if m.fp8 is not None:
        need(m.dtype == "bfloat16", f"model.fp8={m.fp8} needs model.dtype=bfloat16, got {m.dtype}")
        need(
            m.transformer_impl != "local",
            "model.fp8 needs Transformer Engine: model.transformer_impl must be auto or transformer_engine",
        )
    non_negative("model.moe_aux_loss_coeff", m.moe_aux_loss_coeff)
    positive("model.max_seq_len", m.max_seq_len)

    p = cfg.parallel
    for k in ("tp", "pp", "ep", "etp", "cp", "micro_batch_size"):
        need(getattr(p, k) >= 1, f"parallel.{k} must be >= 1, got {getattr(p, k)}")
    budget = p.max_tokens_per_micro_batch
    if budget is not None and budget < 0:
        need(False, f"parallel.max_tokens_per_micro_batch must be >= 0 (0/null = off), got {budget}")
    elif budget:
        seq = -(-m.max_seq_len // (2 * p.cp)) * (2 * p.cp) if p.cp > 1 else m.max_seq_len
        need(
            budget >= seq,
            f"parallel.max_tokens_per_micro_batch={budget} must be >= model.max_seq_len"
            f"{' rounded up to a multiple of 2*parallel.cp' if p.cp > 1 else ''} = {seq} (a sequence is never split)",
        )
    need(
        p.cp == 1 or m.transformer_impl != "local",
        "parallel.cp > 1 needs Transformer Engine attention: model.transformer_impl must be auto or transformer_engine",
    )

    r = cfg.rollout
    need(r.group_size >= 2, f"rollout.group_size must be >= 2 (group-relative advantages), got {r.group_size}")
    positive("rollout.prompts_per_step", r.prompts_per_step)
    positive("rollout.temperature", r.temperature)
    need(0 < r.top_p <= 1, f"rollout.top_p must be in (0, 1], got {r.top_p}")
    need(r.top_k == -1 or r.top_k >= 1, f"rollout.top_k must be -1 (off) or >= 1, got {r.top_k}")
    positive("rollout.max_new_tokens", r.max_new_tokens)
    positive("rollout.sync_bucket_mb", r.sync_bucket_mb)
    positive("rollout.engine_tp", r.engine_tp)
    positive("rollout.engine_ep", r.engine_ep)
    need(
        r.engine_ep <= 1 or (r.engine == "sglang" and r.engine_tp % r.engine_ep == 0),
        f"rollout.engine_ep={r.engine_ep} needs rollout.engine=sglang and must divide rollout.engine_tp={r.engine_tp}",
    )
    non_negative("rollout.num_engines", r.num_engines)
    non_negative("rollout.engine_max_running_requests", r.engine_max_running_requests)
    need(
        r.engine_max_running_requests == 0 or r.engine == "sglang",
        f"rollout.engine_max_running_requests={r.engine_max_running_requests} is sglang's --max-running-requests: "
        "it needs rollout.engine=sglang (or 0)",
    )
    need(0 < r.engine_mem_fraction < 1, f"rollout.engine_mem_fraction must be in (0, 1), got {r.engine_mem_fraction}")
    positive("rollout.engine_timeout_s", r.engine_timeout_s)
    non_negative("rollout.max_engine_restarts", r.max_engine_restarts)
    non_negative("rollout.max_resample_rounds", r.max_resample_rounds)
    need(r.over_sample >= 1, f"rollout.over_sample must be >= 1, got {r.over_sample}")
    need(r.over_sample == 1 or r.dynamic_sampling, "rollout.over_sample > 1 needs rollout.dynamic_sampling=true")

    def callable_spec(name: str, spec: str) -> None:
        """'path/to/file.py:fn' (the file must exist) or 'package.module:fn' (imported by the start-up checks)."""
        target, _, attr = spec.rpartition(":")
        module_form = bool(target) and all(part.isidentifier() for part in target.split("."))
        if not (attr.isidentifier() and (target.endswith(".py") or module_form)) or (
            module_form and not target.endswith(".py") and os.path.isfile(target)
        ):
            e.append(f"{name} {spec!r} must be 'path/to/file.py:function_name' or 'package.module:function_name'")
        elif target.endswith(".py"):
            exists(name, target, "file")

    if r.custom_function is not None:
        callable_spec("rollout.custom_function", r.custom_function)
    non_negative("rollout.max_staleness", r.max_staleness)
    non_negative("rollout.sync_verify_every", r.sync_verify_every)
    non_negative("rollout.sync_verify_tol", r.sync_verify_tol)
    lora = cfg.model.lora
    need(lora.rank >= 0, f"model.lora.rank must be >= 0 (0 = off), got {lora.rank}")
    if lora.rank > 0:
        from gspo_megatron.config.schema import LoraConfig

        known = LoraConfig().target_modules
        need(lora.alpha > 0, f"model.lora.alpha must be > 0, got {lora.alpha}")
        need(0.0 <= lora.dropout < 1.0, f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
        need(bool(lora.target_modules), "model.lora.target_modules must name at least one layer")
        for t in lora.target_modules:
            need(
                t.split(".")[-1] in known,
                f"model.lora.target_modules entry {t!r} must end in one of {', '.join(known)}",
            )
        need(
            not m.fp8,
            "model.lora runs without model.fp8 (set model.fp8=null): Transformer Engine would quantize the "
            "frozen base GEMMs' inputs, not the adapters'",
        )
    e.extend(feature_config_errors(cfg))  # each component's checks and refusals (features/)
    need(
        m.max_seq_len >= cfg.data.max_prompt_len + r.max_new_tokens,
        f"model.max_seq_len={m.max_seq_len} must be >= data.max_prompt_len + rollout.max_new_tokens "
        f"= {cfg.data.max_prompt_len} + {r.max_new_tokens}",
    )

    g = cfg.gspo
    assert g.clip_low is not None and g.clip_high is not None, "the loader resolves them (config.loader._resolve)"
    positive("gspo.clip_low", g.clip_low)
    need(g.clip_low < 1, f"gspo.clip_low must be < 1 (the lower bound is 1 - clip_low), got {g.clip_low}")
    positive("gspo.clip_high", g.clip_high)
    non_negative("gspo.kl_coef", g.kl_coef)
    non_negative("gspo.entropy_coef", g.entropy_coef)
    positive("gspo.adv_eps", g.adv_eps)
    if g.tis_cap is not None:
        positive("gspo.tis_cap", g.tis_cap)
    need(g.mini_batches >= 1, f"gspo.mini_batches must be >= 1, got {g.mini_batches}")
    objective = _policy_objective(g.mode, e)
    need(
        objective is None or objective.config_token_mean or g.loss_agg == "seq-mean-token-mean",
        f"gspo.loss_agg={g.loss_agg} is not allowed with gspo.mode={g.mode}: GSPO weighs every sequence "
        "equally, use seq-mean-token-mean (token-mean is for mode grpo)",
    )
    need(
        objective is None or not objective.sequence_ratio or g.tis_level in (None, "sequence"),
        f"gspo.tis_level={g.tis_level} is not allowed with gspo.mode={g.mode}: it has one ratio per sequence, "
        "so the engine/trainer weight is per sequence too (tis_level: sequence)",
    )
    step = cfg.step_batch_size
    if g.mini_batches >= 1 and p.micro_batch_size >= 1 and not budget:
        need(step % (g.mini_batches * p.micro_batch_size) == 0, _batch_rule(cfg, dp=1))

    o = cfg.optimizer
    positive("optimizer.lr", o.lr)
    need(0 <= o.min_lr <= o.lr, f"optimizer.min_lr must be in [0, optimizer.lr={o.lr}], got {o.min_lr}")
    non_negative("optimizer.weight_decay", o.weight_decay)
    for k in ("adam_beta1", "adam_beta2"):
        need(0 <= getattr(o, k) < 1, f"optimizer.{k} must be in [0, 1), got {getattr(o, k)}")
    positive("optimizer.adam_eps", o.adam_eps)
    non_negative("optimizer.clip_grad", o.clip_grad)
    non_negative("optimizer.lr_warmup_steps", o.lr_warmup_steps)
    need(
        0 <= o.cpu_offload_fraction <= 1,
        f"optimizer.cpu_offload_fraction must be in [0, 1], got {o.cpu_offload_fraction}",
    )
    need(
        o.cpu_offload_fraction == 0 or p.use_distributed_optimizer,
        "optimizer.cpu_offload_fraction > 0 needs parallel.use_distributed_optimizer=true",
    )
    need(o.max_bad_steps >= 1, f"optimizer.max_bad_steps must be >= 1, got {o.max_bad_steps}")

    positive("train.steps", cfg.train.steps)
    positive("train.log_interval", cfg.train.log_interval)

    d = cfg.data
    tasks = _builtin_tasks()
    if d.path is not None:
        need(d.path.endswith((".jsonl", ".parquet")), f"data.path must end in .jsonl or .parquet, got {d.path!r}")
        exists("data.path", d.path, "file")
    elif d.task is None:
        need(False, "data.path or data.task must be set")
    else:
        need(d.task in tasks, f"data.task {d.task!r} is not a built-in task; built-in: {', '.join(tasks)}")
    need(bool(d.prompt_key), "data.prompt_key must be non-empty")
    need(bool(d.label_key), "data.label_key must be non-empty")
    positive("data.max_prompt_len", d.max_prompt_len)

    fn = cfg.reward.function
    if ":" in fn:
        callable_spec("reward.function", fn)
    else:
        rewards = _builtin_rewards()
        need(
            fn in rewards or fn in tasks,
            f"reward.function {fn!r} is not built in; use one of "
            f"{', '.join(rewards + tasks)}, 'path/to/file.py:fn' or 'package.module:fn'",
        )
    positive("reward.timeout_s", cfg.reward.timeout_s)
    non_negative("reward.num_workers", cfg.reward.num_workers)
    need(
        0 < cfg.reward.max_failure_share <= 1,
        f"reward.max_failure_share must be in (0, 1], got {cfg.reward.max_failure_share}",
    )

    e.extend(_reward_errors(cfg))
    e.extend(_eval_errors(cfg, check_files))

    c = cfg.checkpoint
    non_negative("checkpoint.interval", c.interval)
    non_negative("checkpoint.keep_last", c.keep_last)
    exists("checkpoint.load", c.load, "dir")
    need(
        cfg.logging.wandb_project is None or bool(cfg.logging.wandb_project),
        "logging.wandb_project must be non-empty or null",
    )
    return e


def _reward_errors(cfg: Config) -> list[str]:
    """reward.group / url / batch_size / max_in_flight / retries."""
    from urllib.parse import urlparse

    r, e = cfg.reward, []
    if r.url is not None:
        u = urlparse(r.url)
        if u.scheme not in ("http", "https") or not u.hostname:
            e.append(f"reward.url must be an http:// or https:// URL with a host, got {r.url!r}")
        else:
            try:
                u.port  # noqa: B018 - raises ValueError on a bad port
            except ValueError:
                e.append(f"reward.url has a bad port: {r.url!r}")
    if r.batch_size < 1:
        e.append(f"reward.batch_size must be >= 1, got {r.batch_size}")
    if r.max_in_flight < 1:
        e.append(f"reward.max_in_flight must be >= 1, got {r.max_in_flight}")
    if r.retries < 0:
        e.append(f"reward.retries must be >= 0, got {r.retries}")
    return e


def parse_eval_dataset(entry: str) -> tuple[str, str]:
    """An eval.datasets entry -> (name, source): 'name=path', 'path' (name: the file stem), or
    'task:NAME' / 'name=task:NAME' (source 'task:NAME')."""
    name, sep, source = entry.partition("=")
    if not sep:
        source = entry
        name = entry[len("task:") :] if entry.startswith("task:") else os.path.splitext(os.path.basename(entry))[0]
    return name.strip(), source.strip()


def _eval_errors(cfg: Config, check_files: bool) -> list[str]:
    v, e = cfg.eval, []
    if v.interval < 0:
        e.append(f"eval.interval must be >= 0 (0 = no evaluation), got {v.interval}")
    if v.interval > 0 and not v.datasets:
        e.append(f"eval.interval={v.interval} needs eval.datasets (one or more eval sets)")
    if v.n < 1:
        e.append(f"eval.n must be >= 1, got {v.n}")
    if v.temperature <= 0:
        e.append(f"eval.temperature must be > 0, got {v.temperature}")
    if v.max_prompts < 0:
        e.append(f"eval.max_prompts must be >= 0 (0 = all rows), got {v.max_prompts}")
    for i, k in enumerate(v.pass_k):
        if not 1 <= k <= v.n:
            e.append(f"eval.pass_k[{i}]={k} must be in [1, eval.n={v.n}] (pass@k draws k of the n samples)")
    names: set[str] = set()
    tasks = _builtin_tasks()
    for i, entry in enumerate(v.datasets):
        name, source = parse_eval_dataset(entry)
        where = f"eval.datasets[{i}] {entry!r}"
        if not name or not source or "/" in name or any(c.isspace() for c in name):
            e.append(f"{where} must be 'name=path', 'path' or 'task:NAME' (a name without '/' or spaces)")
            continue
        if name in names:
            e.append(f"{where}: the name {name!r} is used twice (metrics eval/{name}/...); use 'name=path'")
        names.add(name)
        if source.startswith("task:"):
            if source[5:] not in tasks:
                e.append(f"{where}: {source[5:]!r} is not a built-in task; built-in: {', '.join(tasks)}")
        elif not source.endswith((".jsonl", ".parquet")):
            e.append(f"{where}: the file must end in .jsonl or .parquet")
        elif check_files and not os.path.isfile(source):
            e.append(f"{where}: file {source!r} does not exist")
    return e


def _batch_rule(cfg: Config, dp: int) -> str:
    r, g, p = cfg.rollout, cfg.gspo, cfg.parallel
    need = g.mini_batches * dp * p.micro_batch_size
    return (
        f"rollout.prompts_per_step * rollout.group_size = {r.prompts_per_step} * {r.group_size} = "
        f"{cfg.step_batch_size} sequences per step must be divisible by gspo.mini_batches * data-parallel "
        f"size * parallel.micro_batch_size = {g.mini_batches} * {dp} * {p.micro_batch_size} = {need} "
        "(each mini-batch is split evenly over the data-parallel ranks, and each rank's share into whole "
        "micro-batches)"
    )


def data_parallel_size(cfg: Config, world_size: int) -> int:
    """DP = training ranks / (tp * pp * cp)."""
    p = cfg.parallel
    return world_size // (p.tp * p.pp * p.cp)


def micro_batches_per_rank(cfg: Config, world_size: int) -> int:
    """Micro-batches each DP rank runs per optimizer step (mini-batch)."""
    dp = data_parallel_size(cfg, world_size)
    return cfg.step_batch_size // (cfg.gspo.mini_batches * dp * cfg.parallel.micro_batch_size)


def engine_count(cfg: Config, world_size: int) -> int:
    """Number of rollout engines, resolving num_engines=0 (auto)."""
    r = cfg.rollout
    if r.num_engines:
        return r.num_engines
    if r.engine_urls:
        return len(r.engine_urls)
    return world_size // r.engine_tp if SYNC_MODES[r.sync_mode].colocated else 1


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Checks that need the number of training ranks (torch.distributed world; with disaggregated
    engines the engines' GPUs are not part of it). Called by every rank before any heavy start."""
    if world_size is None:
        errs = _static_errors(cfg, check_files=False)
        if errs:
            raise ConfigError(errs)
        return
    from gspo_megatron.parallel_layout import layout_errors

    p, r = cfg.parallel, cfg.rollout
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    e = layout_errors(p.tp, p.pp, p.ep, p.etp, p.cp, world_size=world_size)
    if not e:
        dp = data_parallel_size(cfg, world_size)
        if not p.max_tokens_per_micro_batch and cfg.step_batch_size % (cfg.gspo.mini_batches * dp * p.micro_batch_size):
            e.append(_batch_rule(cfg, dp))
    if SYNC_MODES[r.sync_mode].colocated:
        if world_size % r.engine_tp:
            e.append(
                f"rollout.engine_tp={r.engine_tp} must divide the number of training GPUs {world_size} "
                "(colocated engines share them)"
            )
        elif r.num_engines and r.num_engines * r.engine_tp != world_size:
            e.append(
                f"rollout.num_engines * rollout.engine_tp = {r.num_engines} * {r.engine_tp} must equal the "
                f"number of training GPUs {world_size} with colocated engines (or set num_engines: 0 = auto)"
            )
    if e:
        raise ConfigError(e)


def validate_model_layout(cfg: Config, hf_config: dict) -> None:
    """Checks of the parallel layout (``parallel_layout.layout_errors``) and the engines' layout against
    the model's dims (``hf_config``: config.json as a dict)."""
    from gspo_megatron.models.dims import ModelDims
    from gspo_megatron.parallel_layout import layout_errors

    d = ModelDims.from_hf_config(hf_config)
    p, r = cfg.parallel, cfg.rollout
    e = layout_errors(p.tp, p.pp, p.ep, p.etp, p.cp, hf=hf_config, sequence_parallel=p.sequence_parallel)

    if cfg.model.max_seq_len > d.max_position_embeddings and d.rope_type == "default":
        e.append(
            f"model.max_seq_len={cfg.model.max_seq_len} exceeds the model's max_position_embeddings "
            f"= {d.max_position_embeddings}"
        )
    for feature in enabled_features(cfg):  # each component's checks against the model (features/)
        e.extend(feature.model_errors(cfg, d))
    if r.engine == "sglang":
        from gspo_megatron.engines.engine_model import engine_layout_errors, engine_model_errors

        if d.num_heads % r.engine_tp:
            e.append(f"rollout.engine_tp={r.engine_tp} must divide num_attention_heads = {d.num_heads}")
        e.extend(engine_layout_errors(cfg, d))
        e.extend(engine_model_errors(cfg, hf_config))
        # (what sglang's start-up would abort on: fleet.engine_startup_checks, called by its callers,
        # preflight.check_config and planner.make_plan, since it derives the engines' flags from the config)
    if e:
        raise ConfigError(e)
