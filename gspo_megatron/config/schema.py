"""The config schema: one dataclass per section (each component's knobs), with defaults and one-line help.

Defaults describe the CPU demo (a tiny random MoE learning a built-in task); the GPU recipes in
``configs/`` override them. Loading is in :mod:`gspo_megatron.config.loader`, checks in
:mod:`gspo_megatron.config.validation`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Literal


def _f(default: Any, help: str, choices: Callable[[], tuple[str, ...]] | None = None) -> Any:
    """A dataclass field whose one-line description feeds :func:`config_help`. ``choices``: the allowed
    values, asked of a registry when the config is loaded (the loader checks them like a Literal's)."""
    meta: dict[str, Any] = {"help": help} if choices is None else {"help": help, "choices": choices}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


def _policy_loss_modes() -> tuple[str, ...]:
    from gspo_megatron.losses.objectives import policy_loss_modes

    return policy_loss_modes()


def _distill_losses() -> tuple[str, ...]:
    from gspo_megatron.losses.distill_loss import distill_loss_names

    return distill_loss_names()


def _sync_modes() -> tuple[str, ...]:
    from gspo_megatron.features.sync_modes import sync_mode_names

    return sync_mode_names()


def values_for(target: type, *sections: Any, renamed: dict[str, str] | None = None, **given: Any) -> dict[str, Any]:
    """The keyword arguments of a component's options dataclass ``target``, read from config sections
    by field name (``renamed``: target field -> config key, where they differ), so that no caller
    copies config values field by field. ``given`` supplies derived values. Raises TypeError naming
    a field of ``target`` that no section has (a config key renamed without the component)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(target):
        if f.name in given:
            out[f.name] = given[f.name]
            continue
        key = (renamed or {}).get(f.name, f.name)
        owner = next((s for s in sections if hasattr(s, key)), None)
        if owner is None:
            raise TypeError(
                f"{target.__name__}.{f.name}: no config key {key!r} in {', '.join(type(s).__name__ for s in sections)}"
            )
        out[f.name] = getattr(owner, key)
    return out


@dataclass
class LoraConfig:
    # -- LoRA adapters, the base frozen (gspo_megatron/models/lora.py; docs/training.md "LoRA")
    rank: int = _f(0, "LoRA rank r; 0 = off (every parameter trained)")
    alpha: float = _f(16.0, "LoRA alpha: the adapter output is scaled by alpha / rank")
    dropout: float = _f(0.0, "dropout on the adapter input (training forward only)")
    target_modules: list[str] = _f(
        [
            "linear_qkv",
            "linear_proj",
            "linear_q_proj",
            "linear_q_down_proj",
            "linear_q_up_proj",
            "linear_kv_down_proj",
            "linear_kv_up_proj",
            "linear_fc1",
            "linear_fc2",
        ],
        "Megatron linear layers that get adapters: a module name (linear_fc1: dense MLP, shared and routed experts) or a dotted suffix of its path (experts.linear_fc1: routed experts only; shared_experts.linear_fc2; self_attention.linear_qkv); each entry must match a layer of the model",
    )


@dataclass
class ModelConfig:
    arch: str | None = _f(
        "tiny-qwen3-moe",
        "built-in architecture (models.arch.KNOWN_ARCHS) whose config.json dims are used when model.hf_path has no config.json; null: detect from model.hf_path's name",
    )
    hf_path: str | None = _f(None, "HF directory with config.json (+ weights, tokenizer) to start from")
    checkpoint: str | None = _f(None, "Megatron dist checkpoint to start from (overrides hf_path's weights)")
    init: Literal["pretrained", "random"] = _f(
        "random", "pretrained: load weights; random: build from the HF config with random weights"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = _f("float32", "parameter / compute dtype")
    fp8: Literal["e4m3", "hybrid"] | None = _f(None, "FP8 training through Transformer Engine (GPU only); null = off")
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = _f(
        "delayed", "Transformer Engine FP8 scaling recipe"
    )
    transformer_impl: Literal["auto", "local", "transformer_engine"] = _f(
        "auto", "layer implementation; auto = transformer_engine with a GPU, local without"
    )
    moe_token_dispatcher: Literal["alltoall", "allgather"] = _f("alltoall", "Megatron MoE token dispatcher")
    moe_aux_loss_coeff: float = _f(0.0, "load-balancing auxiliary loss coefficient (0 = off)")
    recompute: bool = _f(False, "full activation recomputation (store only each layer's input)")
    fused_logprobs: bool = _f(
        True,
        "log-probs / entropy straight from the last hidden states, the output layer fused in and recomputed per token chunk in backward (no [tokens, V/tp] logits; gspo_megatron/losses/fused_logprobs.py); false: the output layer's logits, then the chunked vocab-parallel log-probs",
    )
    max_seq_len: int = _f(
        64,
        "max prompt + response tokens of one sequence: must cover data.max_prompt_len + rollout.max_new_tokens and fit the model's max_position_embeddings; the memory planner sizes activations and KV cache with it",
    )
    mtp: bool | None = _f(
        None,
        "the checkpoint's multi-token-prediction (MTP) layers in the trained Megatron model (models/mtp.py): trained with gspo.mtp_loss_coef and sent by every weight sync to the engines' draft (rollout.speculative); false: carried unchanged through conversion and export, the engines keep the published draft; null: on with rollout.speculative",
    )
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ParallelConfig:
    tp: int = _f(1, "tensor parallel size")
    pp: int = _f(1, "pipeline parallel size")
    ep: int = _f(1, "expert parallel size")
    etp: int | None = _f(None, "expert tensor parallel size; null = same as tp (resolved on load)")
    cp: int = _f(1, "context parallel size (needs Transformer Engine)")
    sequence_parallel: bool | None = _f(None, "null = auto (on when tp > 1); required for MoE with tp > 1")
    micro_batch_size: int = _f(
        4, "sequences per micro-batch (padded rows; used when max_tokens_per_micro_batch is off)"
    )
    max_tokens_per_micro_batch: int | None = _f(
        None,
        "sequence packing: micro-batches of whole sequences concatenated up to this many tokens, balanced over data-parallel ranks by tokens (THD with Transformer Engine; an exact block-diagonal mask on the local spec); 0/null = off (padded rows of micro_batch_size); must be >= model.max_seq_len",
    )
    use_distributed_optimizer: bool = _f(True, "shard optimizer states over data-parallel ranks (ZeRO-1)")
    grad_reduce_in_fp32: bool = _f(True, "fp32 main-grad buffer and gradient all-reduce")


@dataclass
class RolloutConfig:
    engine: Literal["hf", "sglang"] = _f("hf", "hf: in-process transformers engine (CPU); sglang: SGLang servers (GPU)")
    engine_server: Literal["sglang", "cpu"] = _f(
        "sglang",
        "with engine=sglang: the server program; sglang: the real SGLang server (GPU); cpu: the CPU stand-in that speaks SGLang's HTTP API (gspo_megatron.cpu_server; for tests and CI, not an inference server)",
    )
    group_size: int = _f(8, "G: responses sampled per prompt (>= 2)")
    prompts_per_step: int = _f(8, "prompts per rollout step (step batch = prompts_per_step * group_size sequences)")
    temperature: float = _f(1.0, "sampling temperature (> 0)")
    top_p: float = _f(1.0, "nucleus sampling, in (0, 1]")
    top_k: int = _f(-1, "top-k sampling; -1 = off")
    max_new_tokens: int = _f(8, "max response tokens")
    stop: list[str] = _f([], "extra stop strings (the tokenizer's EOS always stops)")
    sync_mode: str = _f(
        "inprocess",
        "weight sync transport (features/sync_modes.py): inprocess (hf engine), colocated (CUDA IPC, engines share the training GPUs), disaggregated (NCCL broadcast to separate GPUs)",
        choices=_sync_modes,
    )
    sync_bucket_mb: float = _f(512.0, "weight-sync bucket size in MiB")
    sync_verify: bool = _f(
        True,
        "check every engine after each sync: every sync, that it reports the weight version just pushed (one /model_info call per engine); on the syncs sync_verify_every picks, also its log-probs of a greedy probe batch against the trainer's (max abs difference <= sync_verify_tol); false = no check",
    )
    sync_verify_every: int = _f(
        10,
        "with sync_verify: run the log-prob probe on the first sync of a run (or resume), on the first sync after an engine restart, and then every N-th sync; 1 = every sync; 0 = never (weight version check only)",
    )
    sync_verify_tol: float = _f(
        0.0,
        "sync_verify tolerance on the max abs log-prob difference; 0 = by dtype (1e-3 float32, 0.25 bfloat16/float16; 1.0 with sync_fp8)",
    )
    sync_fp8: bool = _f(
        False,
        "quantize weights to FP8 on sync (sglang engines the trainer launches; not with rollout.engine_urls, which start from the bf16 checkpoint)",
    )
    sync_delta: bool = _f(
        False,
        "send per tensor only the elements changed since the last sync (weight_sync/delta.py; sync_mode=colocated: through the CUDA IPC route; disaggregated / engine_urls: the changes (and whole tensors) in files under sync_delta_dir, named to the engines by HTTP (weight_sync/delta_http.py); the trainer's sending ranks keep a host copy of the model in the engine dtype, every engine TP rank one of the tensors it loads (its EP rank's experts); with sync_fp8 the FP8 codes and block scales are compared and sent; full syncs at start, on resume and after an engine restart or a failed sync)",
    )
    sync_owner_direct: bool = _f(
        False,
        "sync_mode=colocated: routed expert weights go only to the engine TP ranks that load them (engine_ep), read by CUDA IPC (shared memory on CPU) from the rank on their node that holds them (the expert's owner, or one copy per node received from it) instead of a broadcast of the whole model to every training rank (weight_sync/owner_direct.py); with sync_delta each rank encodes what it serves",
    )
    sync_delta_dir: str | None = _f(
        None,
        "sync_delta with engines on other hosts (disaggregated): where each sync writes the encoded changes (and whole tensors) the engines read (safetensors, removed after each sync); must be visible to the engine hosts at the same path; default <output_dir>/sync_delta",
    )
    offload_train: bool = _f(
        False,
        "colocated (or in-process) engines: move training weights/grads/optimizer states to host memory while the engines generate (gspo_megatron/trainer/offload.py)",
    )
    engine_tp: int = _f(1, "tensor parallel size of one engine")
    engine_ep: int = _f(
        1,
        "expert parallel size inside one SGLang engine (its --ep-size; divides engine_tp); with sync_fp8 an MoE model needs moe_intermediate_size / (engine_tp / engine_ep) to be a multiple of 128",
    )
    num_engines: int = _f(0, "number of engines; 0 = auto (colocated: training GPUs / engine_tp; hf: 1)")
    engine_mem_fraction: float = _f(
        0.8, "fraction of a GPU's memory an engine fills (weights + KV cache), SGLang's mem_fraction_static"
    )
    engine_max_running_requests: int = _f(
        0,
        "sglang --max-running-requests of each engine (requests it runs at once); 0 = auto: not set (sglang's own "
        "limit from its KV cache, at least 2048 where memory allows), except with rollout.speculative, where sglang "
        "0.5.23 would cap it at 48 and the trainer sets the requests a rollout sends at once (fleet/engine_args.py "
        "rollout_requests) so that a batch is not generated in waves of 48; N >= 1: N (48 keeps sglang's speculative "
        "default, for when verifying drafts at a large batch costs more than it saves)",
    )
    engine_urls: list[str] = _f([], "already running engines to use (disaggregated); empty = launch them")
    router_url: str | None = _f(None, "sglang router in front of engine_urls (launch/slurm/train.sbatch sets it)")
    engine_timeout_s: float = _f(600.0, "seconds to wait for one engine request")
    engine_launch_timeout_s: float = _f(
        1800.0, "seconds to wait for a launched (or restarted) engine to answer /health_generate"
    )
    engine_deterministic: bool = _f(
        False,
        "sglang: start the engines with --enable-deterministic-inference and send per-sample sampling seeds (SGLang ignores the seeds otherwise; slower kernels); the hf engine always seeds",
    )
    max_engine_restarts: int = _f(2, "engine restarts allowed before the run stops")
    engine_process: bool = _f(
        False, "hf engine: run it in a child process (a crash is detected, the engine restarted and the step retried)"
    )
    dynamic_sampling: bool = _f(False, "drop groups whose rewards are all equal and resample to refill the batch")
    max_resample_rounds: int = _f(3, "resampling rounds per step for dynamic_sampling")
    speculative: bool = _f(
        False,
        "speculative decoding with the checkpoint's MTP layers as the draft (sglang --speculative-algorithm EAGLE, top-k 1, speculative_steps draft tokens per verify; features/speculative.py); with model.mtp (the default) the draft is the trained model's MTP layers, synced every step",
    )
    speculative_steps: int = _f(
        3,
        "with speculative: draft steps per target verify (sglang --speculative-num-steps; --speculative-num-draft-tokens = steps + 1)",
    )
    # off-policy overlap (gspo_megatron/orchestration/async_producer.py, docs/training.md)
    max_staleness: int = _f(
        0,
        "0 = synchronous loop (rollout -> train -> sync); N >= 1 (sync_mode=disaggregated only): the engines generate the next batches while the trainer trains, and no sample in an optimizer step was generated by weights more than N steps old",
    )
    inflight_updates: Literal["off", "in_place", "retract", "abort"] = _f(
        "off",
        "engines that never drain (needs max_staleness >= 1, sync_mode=disaggregated; gspo_megatron/orchestration/inflight.py): the producer keeps rollout.inflight_groups groups generating, a step trains on the groups that finished, and each sync pauses the engines in this sglang /pause_generation mode, updates and continues: in_place (requests keep their KV cache; tokens sampled over a prefix of older weights take the engine's log-prob as behaviour), retract (requests are prefilled again under the new weights), abort (slime's partial rollout: the partial output comes back and its continuation is resubmitted); every token carries the version that sampled it",
    )
    inflight_groups: int = _f(
        0,
        "with inflight_updates: the prompt groups generating or finished and not yet trained, at most (0 = 2 * prompts_per_step; must exceed prompts_per_step, or the engines drain every step)",
    )
    over_sample: float = _f(
        1.0,
        "with dynamic_sampling: draw ceil(over_sample * needed) prompts at once and stop generating once enough groups with unequal rewards are in (1.0 = off: resample in rounds)",
    )
    custom_function: str | None = _f(
        None,
        "custom rollout hook 'path/to/file.py:fn' or 'package.module:fn', called as fn(generate, sample) -> dict per sample (multi-turn, tools; gspo_megatron/engines/custom.py; the rollout.* sampling settings, max_new_tokens included, are the defaults of each generate call); null = one generate call per sample",
    )
    routing_replay: Literal["off", "r2", "r3"] = _f(
        "off",
        "MoE routing replay (gspo_megatron/trainer/route_replay.py, docs/training.md \"Routing replay\"): off; r3: the engines return each token's routed experts (sglang --enable-return-routed-experts) and both trainer forwards (old policy, policy) replay them; r2: the trainer's old-policy forward records its own routes and the policy forward replays them. MoE models only; holds under model.recompute (the forward recomputed in backward replays the same routes)",
    )
    lora_sync: Literal["merged", "adapter"] = _f(
        "merged",
        "with model.lora: merged: the export stream merges the adapters into the base weights and the existing sync sends the merged model (every engine, every sync mode); adapter: the engines keep the base (sent unmerged on the first sync and after an engine restart) and each sync sends only the adapters (gathered from every TP / PP / EP shard; routed experts as sglang's per-expert experts.<e>.*_proj adapters), as a new sglang LoRA adapter <name>-v<N> (colocated: /load_lora_adapter_from_tensors; disaggregated / rollout.engine_urls: a PEFT directory under rollout.lora_adapter_dir and /load_lora_adapter; the previous version unloaded) that every rollout request names in lora_path (weight_sync/lora_adapter.py; rollout.engine=sglang, no sync_delta / sync_fp8)",
    )
    lora_adapter_dir: str = _f(
        "",
        "with lora_sync=adapter and engines not colocated (sync_mode=disaggregated or rollout.engine_urls): where each sync writes the adapter as a PEFT directory <dir>/<name>-v<N> for sglang's /load_lora_adapter (a version's directory is removed once unloaded); it must be visible at the same path on the engine hosts (a shared filesystem); empty = <output_dir>/lora_adapters",
    )


@dataclass
class GSPOConfig:
    mode: str = _f(
        "gspo",
        "policy loss (losses/objectives.py, or any registered with register_policy_loss): sequence ratio (gspo), per-token GSPO (gspo_token), token ratio (grpo)",
        choices=_policy_loss_modes,
    )
    clip_low: float | None = _f(
        None, "eps_low, clip range [1 - clip_low, 1 + clip_high]; null = 3e-4 (gspo modes) / 0.2 (grpo)"
    )
    clip_high: float | None = _f(None, "eps_high; null = 4e-4 (gspo modes) / 0.2 (grpo)")
    kl_coef: float = _f(0.0, "coefficient of the KL to a frozen reference policy (0 = off, no reference model)")
    kl_estimator: Literal["k1", "k2", "k3"] = _f("k3", "KL estimator")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    std_normalize: bool = _f(True, "divide advantages by the group's reward std")
    adv_eps: float = _f(1e-6, "eps in A = (r - mean) / (std + eps)")
    tis_cap: float | None = _f(None, "truncated importance sampling cap on pi_trainer_old / pi_engine; null = off")
    tis_level: Literal["token", "sequence"] | None = _f(
        None,
        "with tis_cap: the weight per sequence (the geometric mean of the response tokens' ratios exp(mean_t(old - engine)), never their product) or per token; null = the mode's own (sequence for gspo / gspo_token, token for grpo); gspo takes only sequence",
    )
    tis_mode: Literal["truncate", "mask"] = _f(
        "truncate",
        "with tis_cap: truncate (w = min(ratio, tis_cap)) or mask (w = ratio where ratio <= tis_cap, else 0: the sequence or token is dropped from the loss)",
    )
    mtp_loss_coef: float = _f(
        0.0,
        "coefficient of the MTP draft's loss (cross entropy of each MTP layer's prediction of the rollout's next-next tokens, the main model's hidden states, embeddings and output weight detached: only the MTP layers learn from it; needs model.mtp); 0 = the MTP layers are not trained",
    )
    mini_batches: int = _f(2, "optimizer steps per rollout batch (>= 1)")
    loss_agg: Literal["seq-mean-token-mean", "token-mean"] = _f(
        "seq-mean-token-mean",
        "loss aggregation: seq-mean-token-mean (each sequence's token mean, averaged over the mini-batch's sequences) or token-mean (sum over the mini-batch's response tokens / their global count; mode grpo only)",
    )


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
    lr_decay_style: Literal["constant", "cosine", "linear"] = _f(
        "constant", "decay after warmup, over train.steps * gspo.mini_batches optimizer steps"
    )
    cpu_offload_fraction: float = _f(
        0.0,
        "fraction of optimizer states kept in host memory (Megatron optimizer_cpu_offload; needs the distributed optimizer)",
    )
    max_bad_steps: int = _f(3, "consecutive non-finite steps (skipped) before the run stops")
    mtp_lr: float | None = _f(
        None,
        "with model.mtp: the MTP layer's (the draft's) own peak learning rate, decayed like lr (min_lr in the same ratio); null = lr. Adam's step does not scale with gspo.mtp_loss_coef, so this sets how fast the draft follows the policy (trainer/optimizer.py)",
    )


@dataclass
class TrainConfig:
    steps: int = _f(20, "rollout steps")
    log_interval: int = _f(
        1, "steps between console log lines when the console shows plain lines (logging.progress=false, or no terminal)"
    )


@dataclass
class DataConfig:
    path: str | None = _f(None, ".jsonl or .parquet prompt file; null = the built-in data.task")
    task: str | None = _f(
        "last_digit", "built-in task name (gspo_megatron.data.tasks.TASKS), used when data.path is null"
    )
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
    max_failure_share: float = _f(
        1.0,
        "stop the run when at least this share of one scoring round's reward calls fail (raise, time out, return a non-number or NaN); 1.0 = only when every call fails; partial failures score 0 and are counted (reward/errors, ...)",
    )
    # -- group and remote rewards (gspo_megatron/rewards/grouping.py, remote.py; docs/training.md "Rewards")
    group: bool = _f(
        False,
        "score a prompt's responses together: reward.function (or the server at reward.url) is called as fn(prompt, responses: list[str], label) -> list[float], one value per response",
    )
    url: str | None = _f(
        None,
        "http(s) URL of a reward server (reward model / judge) that scores batches by POST (schema: gspo_megatron/rewards/remote.py); replaces reward.function; null = score locally",
    )
    batch_size: int = _f(16, "reward.url: items per request (samples; groups with reward.group)")
    max_in_flight: int = _f(4, "reward.url: requests in flight at once")
    retries: int = _f(
        2,
        "reward.url: extra attempts of a request that failed fast (connection refused or reset, HTTP 5xx / 429), with backoff, within the round's reward.timeout_s",
    )


@dataclass
class DistillConfig:
    # -- on-policy distillation (gspo_megatron/distill/, losses/distill_loss.py; docs/training.md "Distillation")
    coef: float = _f(
        0.0,
        "weight c of the distillation term: loss = -(J_policy(reward_coef * A) + c * J_token(A^d)), A^d the distill.loss advantage of every sampled token from the teacher's log-probs, through the policy's own ratio and clip (GSPO-token's form for gspo); 0 = off (no teacher is asked; the loss is GSPO's bitwise)",
    )
    reward_coef: float = _f(
        1.0,
        "weight of the task reward's sequence advantage in the loss; 0 = distillation alone (needs distill.coef > 0)",
    )
    loss: str = _f(
        "reverse_kl",
        "distillation objective (losses/distill_loss.py, or any registered with register_distill_loss): reverse_kl = per-token advantage A^d_t = log p_teacher(y_t) - log p_student(y_t) of the sampled tokens; topk_forward_kl / topk_reverse_kl = a divergence to the teacher's top-k distribution at every response position (needs distill.topk > 0)",
        choices=_distill_losses,
    )
    topk: int = _f(
        0,
        "the teacher's K most likely tokens asked per response position (sglang's top_logprobs_num), for the top-k objectives (distill.loss topk_forward_kl / topk_reverse_kl); 0 = not asked",
    )
    teachers: list[str] = _f(
        [],
        "the teachers, each 'NAME=URL[,URL...]' (running sglang servers of the teacher: their own nodes, launch/slurm/train.sbatch TEACHER_MODEL starts them) or 'NAME=HF_DIR' (rank 0 starts distill.engines_per_teacher servers of it, rollout.engine_server's kind, on rank 0's node: with sglang on the training GPUs, memory released while the student trains); a teacher must share the student's tokenizer",
    )
    teacher_key: str | None = _f(
        None,
        "data column naming each prompt's teacher (one of the NAMEs in distill.teachers; NeMo-RL's multi-teacher MOPD); null = every prompt goes to the only teacher",
    )
    engines_per_teacher: int = _f(1, "servers started per 'NAME=HF_DIR' teacher")
    teacher_tp: int = _f(1, "tensor-parallel size of each started teacher server")
    teacher_mem_fraction: float = _f(
        0.2, "sglang's mem_fraction_static of a started teacher server (it shares the training GPUs)"
    )
    batch_size: int = _f(16, "sequences per teacher scoring request (one /generate with max_new_tokens 0)")
    timeout_s: float = _f(
        300.0, "seconds a teacher scoring request may take; a teacher that does not answer in time stops the run"
    )


@dataclass
class EvalConfig:
    # -- evaluation during training (gspo_megatron/evaluation.py; docs/training.md "Evaluation")
    interval: int = _f(
        0,
        "steps between evaluations; also evaluated before the first step (step 0) and after the last; 0 = no evaluation",
    )
    datasets: list[str] = _f(
        [],
        "eval sets, each 'name=path.jsonl|.parquet', 'path' (name = file stem) or 'task:NAME' (rows of a built-in task); same formats and keys as data.*",
    )
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
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def mtp_in_model(self) -> bool:
        """Whether the trained model holds the checkpoint's MTP layers (``model.mtp``; null: on with
        ``rollout.speculative``): built, trained with ``gspo.mtp_loss_coef`` and synced."""
        return self.rollout.speculative if self.model.mtp is None else bool(self.model.mtp)

    @property
    def step_batch_size(self) -> int:
        """Sequences per rollout step: prompts_per_step * group_size."""
        return self.rollout.prompts_per_step * self.rollout.group_size
