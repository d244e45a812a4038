"""The one typed config: dataclasses loaded from YAML + dotted overrides, validated on load.

Every rank calls :func:`load_config` (cheap, no collectives). Checks that need the world size are in
:func:`validate`; checks that need the model's dimensions (HF config.json as a dict) are in
:func:`validate_model_layout`. Every error names the field (``section.key``) and what is allowed.
Defaults describe the CPU demo (a tiny random MoE learning a built-in task); the GPU recipes in
``configs/`` override them.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from gspo_megatron.errors import UserInputError


class ConfigError(UserInputError):
    """A config that cannot work. ``errors`` lists every problem found, each naming its field."""

    def __init__(self, errors: list[str] | str):
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        msg = self.errors[0] if len(self.errors) == 1 else (
            f"{len(self.errors)} config errors:\n" + "\n".join(f"  - {e}" for e in self.errors))
        super().__init__(msg)


def _f(default: Any, help: str) -> Any:
    """A dataclass field whose one-line description feeds :func:`config_help`."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


# (clip_low, clip_high) per gspo.mode when the config leaves them null; the loss module reads it too.
DEFAULT_CLIP = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.2)}


@dataclass
class ModelConfig:
    arch: str | None = _f("tiny-qwen3-moe", "built-in architecture (planner.KNOWN_ARCHS) whose config.json dims are used when model.hf_path has no config.json; null: detect from model.hf_path's name")
    hf_path: str | None = _f(None, "HF directory with config.json (+ weights, tokenizer) to start from")
    checkpoint: str | None = _f(None, "Megatron dist checkpoint to start from (overrides hf_path's weights)")
    init: Literal["pretrained", "random"] = _f("random", "pretrained: load weights; random: build from the HF config with random weights")
    dtype: Literal["float32", "bfloat16", "float16"] = _f("float32", "parameter / compute dtype")
    fp8: Literal["e4m3", "hybrid"] | None = _f(None, "FP8 training through Transformer Engine (GPU only); null = off")
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = _f("delayed", "Transformer Engine FP8 scaling recipe")
    transformer_impl: Literal["auto", "local", "transformer_engine"] = _f("auto", "layer implementation; auto = transformer_engine with a GPU, local without")
    moe_token_dispatcher: Literal["alltoall", "allgather"] = _f("alltoall", "Megatron MoE token dispatcher")
    moe_aux_loss_coeff: float = _f(0.0, "load-balancing auxiliary loss coefficient (0 = off)")
    recompute: bool = _f(False, "full activation recomputation (store only each layer's input)")
    fused_logprobs: bool = _f(True, "log-probs / entropy straight from the last hidden states, the output layer fused in and recomputed per token chunk in backward (no [tokens, V/tp] logits; gspo_megatron/losses/fused_logprobs.py); false: the output layer's logits, then the chunked vocab-parallel log-probs")
    max_seq_len: int = _f(64, "max prompt + response tokens of one sequence: must cover data.max_prompt_len + rollout.max_new_tokens and fit the model's max_position_embeddings; the memory planner sizes activations and KV cache with it")


@dataclass
class ParallelConfig:
    tp: int = _f(1, "tensor parallel size")
    pp: int = _f(1, "pipeline parallel size")
    ep: int = _f(1, "expert parallel size")
    etp: int | None = _f(None, "expert tensor parallel size; null = same as tp (resolved on load)")
    cp: int = _f(1, "context parallel size (needs Transformer Engine)")
    sequence_parallel: bool | None = _f(None, "null = auto (on when tp > 1); required for MoE with tp > 1")
    micro_batch_size: int = _f(4, "sequences per micro-batch (padded rows; used when max_tokens_per_micro_batch is off)")
    max_tokens_per_micro_batch: int | None = _f(None, "sequence packing: micro-batches of whole sequences concatenated up to this many tokens, balanced over data-parallel ranks by tokens (THD with Transformer Engine; an exact block-diagonal mask on the local spec); 0/null = off (padded rows of micro_batch_size); must be >= model.max_seq_len")
    use_distributed_optimizer: bool = _f(True, "shard optimizer states over data-parallel ranks (ZeRO-1)")
    grad_reduce_in_fp32: bool = _f(True, "fp32 main-grad buffer and gradient all-reduce")


@dataclass
class RolloutConfig:
    engine: Literal["hf", "sglang"] = _f("hf", "hf: in-process transformers engine (CPU); sglang: SGLang servers (GPU)")
    engine_server: Literal["sglang", "cpu"] = _f("sglang", "with engine=sglang: the server program; sglang: the real SGLang server (GPU); cpu: the CPU stand-in that speaks SGLang's HTTP API (gspo_megatron.rollout.cpu_server; for tests and CI, not an inference server)")
    group_size: int = _f(8, "G: responses sampled per prompt (>= 2)")
    prompts_per_step: int = _f(8, "prompts per rollout step (step batch = prompts_per_step * group_size sequences)")
    temperature: float = _f(1.0, "sampling temperature (> 0)")
    top_p: float = _f(1.0, "nucleus sampling, in (0, 1]")
    top_k: int = _f(-1, "top-k sampling; -1 = off")
    max_new_tokens: int = _f(8, "max response tokens")
    stop: list[str] = _f([], "extra stop strings (the tokenizer's EOS always stops)")
    sync_mode: Literal["inprocess", "colocated", "disaggregated"] = _f("inprocess", "weight sync transport: inprocess (hf engine), colocated (CUDA IPC, engines share the training GPUs), disaggregated (NCCL broadcast to separate GPUs)")
    sync_bucket_mb: float = _f(512.0, "weight-sync bucket size in MiB")
    sync_verify: bool = _f(False, "after each sync, check every engine: its weight version, and its log-probs of a greedy probe batch against the trainer's (max abs difference <= sync_verify_tol)")
    sync_verify_tol: float = _f(0.0, "sync_verify tolerance on the max abs log-prob difference; 0 = by dtype (1e-3 float32, 0.25 bfloat16/float16)")
    sync_fp8: bool = _f(False, "quantize weights to FP8 on sync (sglang only)")
    offload_train: bool = _f(False, "colocated (or in-process) engines: move training weights/grads/optimizer states to host memory while the engines generate (gspo_megatron/offload.py)")
    engine_tp: int = _f(1, "tensor parallel size of one engine")
    engine_ep: int = _f(1, "expert parallel size inside one SGLang engine (its --ep-size; divides engine_tp); with sync_fp8 an MoE model needs moe_intermediate_size / (engine_tp / engine_ep) to be a multiple of 128")
    num_engines: int = _f(0, "number of engines; 0 = auto (colocated: training GPUs / engine_tp; hf: 1)")
    engine_mem_fraction: float = _f(0.8, "fraction of a GPU's memory an engine fills (weights + KV cache), SGLang's mem_fraction_static")
    engine_urls: list[str] = _f([], "already running engines to use (disaggregated); empty = launch them")
    router_url: str | None = _f(None, "sglang router in front of engine_urls (launch/slurm/train.sbatch sets it)")
    engine_timeout_s: float = _f(600.0, "seconds to wait for one engine request")
    engine_launch_timeout_s: float = _f(1800.0, "seconds to wait for a launched (or restarted) engine to answer /health_generate")
    engine_deterministic: bool = _f(False, "sglang: start the engines with --enable-deterministic-inference and send per-sample sampling seeds (SGLang ignores the seeds otherwise; slower kernels); the hf engine always seeds")
    max_engine_restarts: int = _f(2, "engine restarts allowed before the run stops")
    engine_process: bool = _f(False, "hf engine: run it in a child process (a crash is detected, the engine restarted and the step retried)")
    dynamic_sampling: bool = _f(False, "drop groups whose rewards are all equal and resample to refill the batch")
    max_resample_rounds: int = _f(3, "resampling rounds per step for dynamic_sampling")
    # off-policy overlap (gspo_megatron/rollout/async_producer.py, docs/training.md)
    max_staleness: int = _f(0, "0 = synchronous loop (rollout -> train -> sync); N >= 1 (sync_mode=disaggregated only): the engines generate the next batches while the trainer trains, and no sample in an optimizer step was generated by weights more than N steps old")
    over_sample: float = _f(1.0, "with dynamic_sampling: draw ceil(over_sample * needed) prompts at once and stop generating once enough groups with unequal rewards are in (1.0 = off: resample in rounds)")
    custom_function: str | None = _f(None, "custom rollout hook 'path/to/file.py:fn' or 'package.module:fn', called as fn(generate, sample) -> dict per sample (multi-turn, tools; gspo_megatron/rollout/custom.py; the rollout.* sampling settings, max_new_tokens included, are the defaults of each generate call); null = one generate call per sample")


@dataclass
class GSPOConfig:
    mode: Literal["gspo", "gspo_token", "grpo"] = _f("gspo", "policy loss: sequence ratio (gspo), per-token GSPO (gspo_token), token ratio (grpo)")
    clip_low: float | None = _f(None, "eps_low, clip range [1 - clip_low, 1 + clip_high]; null = 3e-4 (gspo modes) / 0.2 (grpo)")
    clip_high: float | None = _f(None, "eps_high; null = 4e-4 (gspo modes) / 0.2 (grpo)")
    kl_coef: float = _f(0.0, "coefficient of the KL to a frozen reference policy (0 = off, no reference model)")
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k3", "KL estimator")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    std_normalize: bool = _f(True, "divide advantages by the group's reward std")
    adv_eps: float = _f(1e-6, "eps in A = (r - mean) / (std + eps)")
    tis_cap: float | None = _f(None, "truncated importance sampling cap on pi_trainer_old / pi_engine; null = off")
    mini_batches: int = _f(2, "optimizer steps per rollout batch (>= 1)")
    loss_agg: Literal["seq-mean-token-mean", "token-mean"] = _f("seq-mean-token-mean", "loss aggregation: seq-mean-token-mean (each sequence's token mean, averaged over the mini-batch's sequences) or token-mean (sum over the mini-batch's response tokens / their global count; mode grpo only)")


@dataclass
class OptimizerConfig:
    lr: float = _f(1e-3, "peak learning rate (> 0)")
    min_lr: float = _f(0.0, "final learning rate of the decay")
    weight_decay: float = _f(0.0, "decoupled weight decay")
    adam_beta1: float = _f(0.9, "Adam beta1")
    adam_beta2: float = _f(0.98, "Adam beta2")
    adam_eps: float = _f(1e-8, "Adam eps")
    clip_grad: float = _f(1.0, "global gradient-norm clip (0 = off)")
    lr_warmup_steps: int = _f(0, "linear warmup optimizer steps")
    lr_decay_style: Literal["constant", "cosine", "linear"] = _f("constant", "decay after warmup, over train.steps * gspo.mini_batches optimizer steps")
    cpu_offload_fraction: float = _f(0.0, "fraction of optimizer states kept in host memory (Megatron optimizer_cpu_offload; needs the distributed optimizer)")
    max_bad_steps: int = _f(3, "consecutive non-finite steps (skipped) before the run stops")


@dataclass
class TrainConfig:
    steps: int = _f(20, "rollout steps")
    log_interval: int = _f(1, "steps between console log lines when the console shows plain lines (logging.progress=false, or no terminal)")


@dataclass
class DataConfig:
    path: str | None = _f(None, ".jsonl or .parquet prompt file; null = the built-in data.task")
    task: str | None = _f("last_digit", "built-in task name (gspo_megatron.data.tasks.TASKS), used when data.path is null")
    prompt_key: str = _f("prompt", "column holding the prompt")
    label_key: str = _f("label", "column holding the reference answer")
    apply_chat_template: bool = _f(True, "wrap prompts in the tokenizer's chat template")
    max_prompt_len: int = _f(32, "max prompt tokens")
    skip_bad_rows: bool = _f(False, "skip (and count) malformed rows instead of failing on them")
    shuffle: bool = _f(True, "shuffle prompts each epoch (seeded)")


@dataclass
class RewardConfig:
    function: str = _f("last_digit", "'math', 'exact_match', a built-in task name, or 'path/to/file.py:fn'")
    timeout_s: float = _f(10.0, "seconds allowed per reward call")
    num_workers: int = _f(0, "reward worker processes; 0 = score in the calling process")
    max_failure_share: float = _f(1.0, "stop the run when at least this share of one scoring round's reward calls fail (raise, time out, return a non-number or NaN); 1.0 = only when every call fails; partial failures score 0 and are counted (reward/errors, ...)")
    # -- group and remote rewards (gspo_megatron/rewards/grouping.py, remote.py; docs/training.md "Rewards")
    group: bool = _f(False, "score a prompt's responses together: reward.function (or the server at reward.url) is called as fn(prompt, responses: list[str], label) -> list[float], one value per response")
    url: str | None = _f(None, "http(s) URL of a reward server (reward model / judge) that scores batches by POST (schema: gspo_megatron/rewards/remote.py); replaces reward.function; null = score locally")
    batch_size: int = _f(16, "reward.url: items per request (samples; groups with reward.group)")
    max_in_flight: int = _f(4, "reward.url: requests in flight at once")
    retries: int = _f(2, "reward.url: extra attempts of a request that failed fast (connection refused or reset, HTTP 5xx / 429), with backoff, within the round's reward.timeout_s")


@dataclass
class EvalConfig:
    # -- evaluation during training (gspo_megatron/evaluation.py; docs/training.md "Evaluation")
    interval: int = _f(0, "steps between evaluations; also evaluated before the first step (step 0) and after the last; 0 = no evaluation")
    datasets: list[str] = _f([], "eval sets, each 'name=path.jsonl|.parquet', 'path' (name = file stem) or 'task:NAME' (rows of a built-in task); same formats and keys as data.*")
    n: int = _f(1, "samples per eval prompt")
    greedy: bool = _f(True, "greedy decoding (top_k=1); false = sample with eval.temperature and rollout.top_p / top_k")
    temperature: float = _f(1.0, "sampling temperature when eval.greedy=false")
    pass_k: list[int] = _f([1], "k's of eval/<name>/pass@k (unbiased estimator over eval.n samples; each k <= eval.n)")
    pass_threshold: float = _f(1.0, "a sample counts as correct for pass@k when its reward >= this")
    max_prompts: int = _f(0, "prompts per eval set (the first ones); 0 = all rows (a built-in task: 64)")


@dataclass
class CheckpointConfig:
    interval: int = _f(0, "steps between checkpoints; 0 = only at the end")
    keep_last: int = _f(2, "checkpoints kept; 0 = keep all")
    save_on_signal: bool = _f(True, "checkpoint on SIGTERM/SIGUSR1 (preemption) before exiting")
    load: str | None = _f(None, "checkpoint dir to resume from; null = latest under output_dir/checkpoints")


@dataclass
class LoggingConfig:
    tensorboard: bool = _f(True, "write TensorBoard events under output_dir/tensorboard")
    wandb_project: str | None = _f(None, "Weights & Biases project; null = off")
    progress: bool = _f(True, "progress bar on the console")


@dataclass
class Config:
    output_dir: str = _f("runs/demo", "run directory: checkpoints, metrics.jsonl, resolved config")
    seed: int = _f(1234, "random seed")
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    gspo: GSPOConfig = field(default_factory=GSPOConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def step_batch_size(self) -> int:
        """Sequences per rollout step: prompts_per_step * group_size."""
        return self.rollout.prompts_per_step * self.rollout.group_size


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert a YAML value to the field's type or raise ConfigError naming the field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name)  # our unions are always `X | None`
    bad = ConfigError(f"{name} must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{name} must be one of {', '.join(repr(a) for a in args)}; got {value!r}{hint}")
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise bad
        return [_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and not isinstance(value, bool) and (
            isinstance(value, int) or isinstance(value, float) and value.is_integer()):
        return int(value)
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)  # a str too: YAML 1.1 reads "1e-6" (no dot) as a string
        except ValueError:
            pass
    if tp is str and not isinstance(value, (bool, list, dict, type(None))):
        return str(value)  # numbers and dates read by YAML from a path-like value
    if tp in (bool, int, float, str):
        raise bad
    raise TypeError(f"unsupported field type {tp!r} for {name}")  # a bug in this module


def _did_you_mean(key: str, options: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    return f"unknown key '{prefix}{key}'" + (
        f"; did you mean '{prefix}{close[0]}'?" if close else f"; allowed keys: {', '.join(options)}")


def _apply(obj: Any, data: dict[str, Any], prefix: str, errors: list[str]) -> None:
    """Set fields of the dataclass ``obj`` from a (nested) dict, collecting errors."""
    hints = _hints(type(obj))
    for key, value in data.items():
        key = str(key)
        if key not in hints:
            errors.append(_did_you_mean(key, list(hints), prefix))
            continue
        tp, name = hints[key], prefix + key
        if _is_section(tp):
            if not isinstance(value, dict):
                errors.append(f"{name} must be a mapping of its keys, got {value!r}")
            else:
                _apply(getattr(obj, key), value, name + ".", errors)
            continue
        try:
            setattr(obj, key, _coerce(value, tp, name))
        except ConfigError as e:
            errors.extend(e.errors)


def _override_to_dict(item: str) -> dict[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. rollout.group_size=16)")
    path, raw = item.split("=", 1)
    path = path.strip().lstrip("-")
    if not path or any(not p for p in path.split(".")):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e.__class__.__name__})") from None
    out: dict[str, Any] = {}
    node = out
    parts = path.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def load_config(path: str | None, overrides: list[str] | None = None, *, check_files: bool = True) -> Config:
    """Load ``path`` (YAML; None = defaults), apply ``overrides`` (``a.b=value``, value parsed as
    YAML), resolve automatic values and validate. ``check_files=False`` skips checks that files exist
    (the planner plans recipes whose paths are placeholders). Raises ConfigError."""
    cfg = Config()
    errors: list[str] = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        with open(path) as fh:
            try:
                data = yaml.safe_load(fh)
            except yaml.YAMLError as e:
                raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(data).__name__}")
        file_errors: list[str] = []
        _apply(cfg, data, "", file_errors)
        errors += [f"{path}: {e}" for e in file_errors]
    for item in overrides or []:
        try:
            _apply(cfg, _override_to_dict(item), "", errors)
        except ConfigError as e:
            errors.extend(e.errors)
    if errors:
        raise ConfigError(errors)
    _resolve(cfg)
    errors = _static_errors(cfg, check_files)
    if errors:
        raise ConfigError(errors)
    return cfg


def save_config(cfg: Config, path: str, header: str | None = None) -> None:
    """Write the resolved config as YAML (loadable by :func:`load_config`), ``header`` as a leading
    comment; rank 0 calls it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        if header:
            fh.write("".join(f"# {line}\n" for line in header.splitlines()))
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False, default_flow_style=False)
    os.replace(tmp, path)


def config_help() -> str:
    """Every field as ``section.key: type = default`` and its one-line description."""
    lines = ["Config fields (YAML sections; override any as section.key=value):"]

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if _is_section(tp):
                lines.append(f"\n[{prefix}{f.name}]")
                walk(tp, f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {prefix}{f.name}: {_type_name(tp)} = {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}")
            lines.append(f"      {f.metadata.get('help', '')}")

    walk(Config, "")
    return "\n".join(lines)


def _resolve(cfg: Config) -> None:
    """Fill the automatic values (written as null in YAML) so the saved config shows what ran."""
    low, high = DEFAULT_CLIP[cfg.gspo.mode]
    if cfg.gspo.clip_low is None:
        cfg.gspo.clip_low = low
    if cfg.gspo.clip_high is None:
        cfg.gspo.clip_high = high
    p = cfg.parallel
    if p.etp is None:
        p.etp = p.tp
    if p.sequence_parallel is None or p.tp == 1:  # Megatron disables SP without TP
        p.sequence_parallel = p.tp > 1


BUILTIN_REWARDS = ("math", "exact_match")


def _builtin_tasks() -> list[str]:
    from gspo_megatron.data.tasks import TASKS

    return sorted(TASKS)


def _static_errors(cfg: Config, check_files: bool) -> list[str]:
    """Checks that need neither the world size nor the model dims; every message names its field."""
    e: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            e.append(msg)

    def positive(name: str, value: float | int) -> None:
        need(value > 0, f"{name} must be > 0, got {value}")

    def non_negative(name: str, value: float | int) -> None:
        need(value >= 0, f"{name} must be >= 0, got {value}")

    def exists(name: str, path: str | None, kind: str = "path") -> None:
        if path is not None and check_files:
            ok = os.path.isfile(path) if kind == "file" else os.path.isdir(path) if kind == "dir" else os.path.exists(path)
            need(ok, f"{name}: {kind} {path!r} does not exist")

    need(bool(cfg.output_dir), "output_dir must be a non-empty path")
    non_negative("seed", cfg.seed)

    m = cfg.model
    from gspo_megatron.planner import KNOWN_ARCHS

    if m.arch is not None and m.arch not in KNOWN_ARCHS:
        close = difflib.get_close_matches(m.arch, list(KNOWN_ARCHS), n=1)
        need(False, f"model.arch {m.arch!r} is not a built-in architecture"
             + (f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(KNOWN_ARCHS)}"))
    need(m.init == "random" or m.hf_path or m.checkpoint,
         "model.init=pretrained needs model.hf_path or model.checkpoint")
    need(m.arch or m.hf_path, "model.arch or model.hf_path must say which architecture to build")
    exists("model.hf_path", m.hf_path, "dir")
    if m.hf_path and check_files and os.path.isdir(m.hf_path):
        need(os.path.isfile(os.path.join(m.hf_path, "config.json")), f"model.hf_path: no config.json in {m.hf_path!r}")
    exists("model.checkpoint", m.checkpoint)
    if m.fp8 is not None:
        need(m.dtype == "bfloat16", f"model.fp8={m.fp8} needs model.dtype=bfloat16, got {m.dtype}")
        need(m.transformer_impl != "local", "model.fp8 needs Transformer Engine: model.transformer_impl must be auto or transformer_engine")
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
        need(budget >= seq, f"parallel.max_tokens_per_micro_batch={budget} must be >= model.max_seq_len"
             f"{' rounded up to a multiple of 2*parallel.cp' if p.cp > 1 else ''} = {seq} (a sequence is never split)")
    need(p.cp == 1 or m.transformer_impl != "local",
         "parallel.cp > 1 needs Transformer Engine attention: model.transformer_impl must be auto or transformer_engine")

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
    need(r.engine_ep <= 1 or (r.engine == "sglang" and r.engine_tp % r.engine_ep == 0),
         f"rollout.engine_ep={r.engine_ep} needs rollout.engine=sglang and must divide rollout.engine_tp={r.engine_tp}")
    non_negative("rollout.num_engines", r.num_engines)
    need(0 < r.engine_mem_fraction < 1, f"rollout.engine_mem_fraction must be in (0, 1), got {r.engine_mem_fraction}")
    positive("rollout.engine_timeout_s", r.engine_timeout_s)
    non_negative("rollout.max_engine_restarts", r.max_engine_restarts)
    non_negative("rollout.max_resample_rounds", r.max_resample_rounds)
    need(r.over_sample >= 1, f"rollout.over_sample must be >= 1, got {r.over_sample}")
    need(r.over_sample == 1 or r.dynamic_sampling, "rollout.over_sample > 1 needs rollout.dynamic_sampling=true")
    if r.custom_function is not None:
        file, _, name = r.custom_function.rpartition(":")
        need(bool(file) and name.isidentifier(),
             f"rollout.custom_function {r.custom_function!r} must be 'path/to/file.py:function' or 'package.module:function'")
        if file.endswith(".py"):
            exists("rollout.custom_function", file, "file")
    if r.engine == "hf":
        need(r.sync_mode == "inprocess", f"rollout.sync_mode must be inprocess with rollout.engine=hf, got {r.sync_mode}")
        need(not r.sync_fp8, "rollout.sync_fp8 needs rollout.engine=sglang")
        need(r.num_engines in (0, 1), f"rollout.num_engines must be 0 or 1 with rollout.engine=hf, got {r.num_engines}")
    else:
        need(r.sync_mode in ("colocated", "disaggregated"),
             f"rollout.sync_mode must be colocated or disaggregated with rollout.engine=sglang, got {r.sync_mode}")
    need(not r.engine_urls or r.sync_mode == "disaggregated", "rollout.engine_urls needs rollout.sync_mode=disaggregated")
    need(not r.engine_urls or r.num_engines in (0, len(r.engine_urls)),
         f"rollout.num_engines={r.num_engines} but rollout.engine_urls lists {len(r.engine_urls)} engines")
    need(r.sync_mode != "disaggregated" or r.num_engines >= 1 or r.engine_urls,
         "rollout.num_engines must be >= 1 (or rollout.engine_urls set) with rollout.sync_mode=disaggregated")
    non_negative("rollout.max_staleness", r.max_staleness)
    need(r.max_staleness == 0 or r.sync_mode == "disaggregated",
         f"rollout.max_staleness={r.max_staleness} needs rollout.sync_mode=disaggregated (got {r.sync_mode}): "
         "overlapping generation with training needs engines on their own GPUs; colocated or in-process engines "
         "share the training devices and cannot generate while the trainer trains")
    need(r.max_staleness == 0 or r.custom_function is None,
         "rollout.max_staleness >= 1 with rollout.custom_function is not supported: the hook's records do not carry "
         "the weight version of each token, which off-policy training needs")
    need(not r.offload_train or r.sync_mode != "disaggregated",
         "rollout.offload_train needs engines on the training devices (rollout.sync_mode colocated or inprocess), got disaggregated")
    need(m.max_seq_len >= cfg.data.max_prompt_len + r.max_new_tokens,
         f"model.max_seq_len={m.max_seq_len} must be >= data.max_prompt_len + rollout.max_new_tokens "
         f"= {cfg.data.max_prompt_len} + {r.max_new_tokens}")

    g = cfg.gspo
    positive("gspo.clip_low", g.clip_low)
    need(g.clip_low < 1, f"gspo.clip_low must be < 1 (the lower bound is 1 - clip_low), got {g.clip_low}")
    positive("gspo.clip_high", g.clip_high)
    non_negative("gspo.kl_coef", g.kl_coef)
    non_negative("gspo.entropy_coef", g.entropy_coef)
    positive("gspo.adv_eps", g.adv_eps)
    if g.tis_cap is not None:
        positive("gspo.tis_cap", g.tis_cap)
    need(g.mini_batches >= 1, f"gspo.mini_batches must be >= 1, got {g.mini_batches}")
    need(g.mode == "grpo" or g.loss_agg == "seq-mean-token-mean",
         f"gspo.loss_agg={g.loss_agg} is not allowed with gspo.mode={g.mode}: GSPO weighs every sequence "
         "equally, use seq-mean-token-mean (token-mean is for mode grpo)")
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
    need(0 <= o.cpu_offload_fraction <= 1, f"optimizer.cpu_offload_fraction must be in [0, 1], got {o.cpu_offload_fraction}")
    need(o.cpu_offload_fraction == 0 or p.use_distributed_optimizer,
         "optimizer.cpu_offload_fraction > 0 needs parallel.use_distributed_optimizer=true")
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
        file, _, name = fn.rpartition(":")
        need(file.endswith(".py") and name.isidentifier(),
             f"reward.function {fn!r} must be 'path/to/file.py:function_name'")
        exists("reward.function", file, "file")
    else:
        need(fn in BUILTIN_REWARDS or fn in tasks, f"reward.function {fn!r} is not built in; use one of "
             f"{', '.join(BUILTIN_REWARDS + tuple(tasks))} or 'path/to/file.py:fn'")
    positive("reward.timeout_s", cfg.reward.timeout_s)
    non_negative("reward.num_workers", cfg.reward.num_workers)
    need(0 < cfg.reward.max_failure_share <= 1,
         f"reward.max_failure_share must be in (0, 1], got {cfg.reward.max_failure_share}")

    e.extend(_reward_errors(cfg))
    e.extend(_eval_errors(cfg, check_files))

    c = cfg.checkpoint
    non_negative("checkpoint.interval", c.interval)
    non_negative("checkpoint.keep_last", c.keep_last)
    exists("checkpoint.load", c.load, "dir")
    need(cfg.logging.wandb_project is None or bool(cfg.logging.wandb_project), "logging.wandb_project must be non-empty or null")
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
        name = entry[len("task:"):] if entry.startswith("task:") else os.path.splitext(os.path.basename(entry))[0]
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
    return (f"rollout.prompts_per_step * rollout.group_size = {r.prompts_per_step} * {r.group_size} = "
            f"{cfg.step_batch_size} sequences per step must be divisible by gspo.mini_batches * data-parallel "
            f"size * parallel.micro_batch_size = {g.mini_batches} * {dp} * {p.micro_batch_size} = {need} "
            "(each mini-batch is split evenly over the data-parallel ranks, and each rank's share into whole "
            "micro-batches)")


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
    return world_size // r.engine_tp if r.sync_mode == "colocated" else 1


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Checks that need the number of training ranks (torch.distributed world; with disaggregated
    engines the engines' GPUs are not part of it). Called by every rank before any heavy start."""
    if world_size is None:
        errs = _static_errors(cfg, check_files=False)
        if errs:
            raise ConfigError(errs)
        return
    p, r = cfg.parallel, cfg.rollout
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    e: list[str] = []
    mp = p.tp * p.pp * p.cp
    if world_size % mp:
        e.append(f"parallel.tp * parallel.pp * parallel.cp = {p.tp} * {p.pp} * {p.cp} = {mp} must divide the "
                 f"world size {world_size}")
    emp = p.ep * p.etp * p.pp
    if world_size % emp:
        e.append(f"parallel.ep * parallel.etp * parallel.pp = {p.ep} * {p.etp} * {p.pp} = {emp} must divide the "
                 f"world size {world_size}")
    if not e:
        dp = data_parallel_size(cfg, world_size)
        if not p.max_tokens_per_micro_batch and \
                cfg.step_batch_size % (cfg.gspo.mini_batches * dp * p.micro_batch_size):
            e.append(_batch_rule(cfg, dp))
    if r.sync_mode == "colocated":
        if world_size % r.engine_tp:
            e.append(f"rollout.engine_tp={r.engine_tp} must divide the number of training GPUs {world_size} "
                     "(colocated engines share them)")
        elif r.num_engines and r.num_engines * r.engine_tp != world_size:
            e.append(f"rollout.num_engines * rollout.engine_tp = {r.num_engines} * {r.engine_tp} must equal the "
                     f"number of training GPUs {world_size} with colocated engines (or set num_engines: 0 = auto)")
    if e:
        raise ConfigError(e)


def validate_model_layout(cfg: Config, hf_config: dict) -> None:
    """Checks of the parallel layout against the model's dims (``hf_config``: config.json as a dict)."""
    from gspo_megatron.planner import ModelDims

    d = ModelDims.from_hf_config(hf_config)
    p, r = cfg.parallel, cfg.rollout
    e: list[str] = []

    def divides(field_name: str, size: int, what: str, n: int, why: str = "") -> None:
        if n % size:
            e.append(f"{field_name}={size} must divide {what} = {n}{why}")

    divides("parallel.tp", p.tp, "num_attention_heads", d.num_heads)
    divides("parallel.tp", p.tp, "num_key_value_heads", d.num_kv_heads,
            " (Megatron needs num_query_groups % tp == 0)")
    padded = -(-d.vocab_size // p.tp) * p.tp
    divides("parallel.tp", p.tp, "vocab_size", d.vocab_size,
            f" (the output layer is split over the TP ranks); pad the vocabulary to {padded} rows: with "
            f"transformers, model.resize_token_embeddings({padded}); model.save_pretrained(DIR); then "
            "model.hf_path=DIR; or choose a parallel.tp that divides it")
    if d.num_dense_layers:
        divides("parallel.tp", p.tp, "intermediate_size", d.ffn_hidden)
    if d.num_experts:
        divides("parallel.ep", p.ep, "the number of experts", d.num_experts)
        divides("parallel.etp", p.etp, "moe_intermediate_size", d.moe_ffn_hidden)
        if p.tp > 1 and not p.sequence_parallel:
            e.append("parallel.sequence_parallel must be true for an MoE model with parallel.tp > 1")
    elif p.ep > 1:
        e.append(f"parallel.ep={p.ep} needs an MoE model; {d.model_type} has no experts")
    divides("parallel.pp", p.pp, "num_hidden_layers", d.num_layers)
    try:  # what Megatron-Core cannot build for this family (e.g. gpt_oss: expert biases need etp=1)
        from gspo_megatron.models.registry import get_family

        get_family(hf_config).check_layout(hf_config, p.tp, p.pp, p.ep, p.etp)
    except ValueError as err:
        e.append(str(err))
    if cfg.model.max_seq_len > d.max_position_embeddings and d.rope_type == "default":
        e.append(f"model.max_seq_len={cfg.model.max_seq_len} exceeds the model's max_position_embeddings "
                 f"= {d.max_position_embeddings}")
    if r.engine == "sglang":
        from gspo_megatron.rollout.engine_model import engine_layout_errors

        divides("rollout.engine_tp", r.engine_tp, "num_attention_heads", d.num_heads)
        e.extend(engine_layout_errors(cfg, d))
    if e:
        raise ConfigError(e)
