"""Cluster planner: check a config against a cluster shape and estimate memory per GPU.

``python tools/plan.py --config X --nodes N --gpus-per-node G --gpu-memory-gb M [overrides]`` (or
``gspo-train --dry-run ...``) calls ``plan_report.plan_main`` / ``run_plan``, which print
:func:`make_plan`'s result (``plan_report.format_plan``). Runs on one process, no GPU, no files needed:
model dims come from ``model.hf_path``/config.json when it exists, else from the built-in table
:data:`gspo_megatron.models.arch.KNOWN_ARCHS` (``model.arch``, or detected from ``model.hf_path``'s directory name).

The memory model (per GPU, GiB = 2**30 bytes; an estimate, see docs/planner.md):
- weights: params on this GPU * dtype bytes; non-expert params / tp (norms and router replicated),
  expert params / (ep * etp); each pipeline stage holds its layers (+ embedding on the first, output
  layer on the last). A frozen reference copy is added when gspo.kl_coef > 0.
- gradients: Megatron's main-grad buffer, fp32 (parallel.grad_reduce_in_fp32) or dtype.
- optimizer: Adam fp32 master (not with float32 params) + 2 fp32 moments = 12 (or 8) bytes/param,
  divided over DP (expert params over expert-DP = world / (ep * etp * pp)) with the distributed
  optimizer; the optimizer.cpu_offload_fraction part lives in host memory.
- activations: per micro-batch of micro_batch_size * max_seq_len / cp tokens (max_tokens_per_micro_batch / cp when packing), stored tensors of each
  layer (sequence-parallel, flash attention; full recompute keeps only layer inputs plus one layer),
  times the micro-batches in flight on the stage (1F1B: min(pp - stage, micro-batches)), plus on the
  last stage the log-prob head: with model.fused_logprobs a few [chunk, V/tp] fp32 temporaries, the
  fp32 [V/tp, H] grad_W accumulator and the hidden states' gradient; without, the vocab-parallel
  logits and their gradient.
- runtime overhead: a fixed RUNTIME_OVERHEAD_GIB for the CUDA context, NCCL buffers, fragmentation.
- engines (SGLang semantics): an engine fills engine_mem_fraction of the GPU with its weights
  (bf16, fp8 with sync_fp8, / engine_tp) and the KV cache. Colocated engines release their memory
  during training; while they generate, the training states stay resident unless offload_train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gspo_megatron.config import (
    Config,
    data_parallel_size,
    engine_count,
    micro_batches_per_rank,
    validate,
    validate_model_layout,
)
from gspo_megatron.dtypes import DTYPE_BYTES
from gspo_megatron.errors import ConfigError, UserInputError
from gspo_megatron.losses.chunking import DEFAULT_CHUNK_BYTES
from gspo_megatron.models.arch import model_hf_config
from gspo_megatron.models.dims import ModelDims as _ModelDims
from gspo_megatron.rollout.engine_startup_checks import startup_refusals
from gspo_megatron.weight_sync.modes import sync_mode

GIB = 1 << 30
RUNTIME_OVERHEAD_GIB = 4.0
#: one CUDA context that a process creates on a GPU not its own when it opens a CUDA IPC handle of
#: memory there (``rollout.sync_owner_direct``: an engine TP process opening a holder's buffer on
#: another GPU of the node). 0.3-0.5 GiB on H100s with CUDA 12's lazy loading (reported, not
#: measured here: docs/gpu.md); the upper end is planned for
FOREIGN_CONTEXT_GIB = 0.5


class PlanError(UserInputError):
    """The model or cluster cannot be planned (unknown architecture, not enough GPUs)."""


class ModelDims(_ModelDims):
    """The family's dims (``gspo_megatron.models.dims.ModelDims``); errors become PlanError."""

    @classmethod
    def from_hf_config(cls, c: dict) -> _ModelDims:
        try:
            return _ModelDims.from_hf_config(c)
        except ValueError as e:
            raise PlanError(str(e)) from None


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one layer by how they shard: /tp, replicated over tp, /(ep*etp)."""

    tp_sharded: int
    replicated: int
    expert: int
    active_expert: int  # the topk experts a token uses


def layer_params(d: _ModelDims, layer: int, te: bool = False) -> LayerParams:
    """GQA attention (+ biases, QK-norm, sinks); a SwiGLU MLP (3 matrices, + biases) per dense layer, per
    routed expert and for the shared expert (TP-sharded like a dense MLP; its sigmoid gate [1, hidden]
    replicated); the router (+ its bias). ``te``: the Transformer Engine layer spec (MLA's down
    projections replicated over TP)."""
    if d.mla:
        attn, norms = _mla_params(d, te)
    else:
        q, kv = d.q_size, d.kv_size
        attn = d.hidden * q + 2 * d.hidden * kv + q * d.hidden
        attn += (q + 2 * kv) * d.qkv_bias + d.hidden * d.o_bias
        # q/k norms: per head (head_dim each), or over all heads at once (MiniMax-M2: q_size + kv_size)
        norms = 2 * d.hidden + ((q + kv) if d.qk_norm_full_width else 2 * d.head_dim) * d.qk_norm
    attn += d.num_heads * d.attention_sinks  # sinks: split over TP with the heads
    # DSA lightning indexer (DeepSeek-V3.2 / GLM-5): wq_b, wk, k_norm (+ bias), weights_proj; replicated over TP;
    # none on GLM-5's "shared" layers (they reuse an earlier layer's selection)
    norms += (layer not in d.index_shared_layers) * (
        d.q_lora_rank * d.index_n_heads * d.index_head_dim
        + d.hidden * d.index_head_dim
        + 2 * d.index_head_dim
        + d.hidden * d.index_n_heads
    )
    attn += d.hidden * d.q_size * d.attention_output_gate  # gated attention: q_proj also gives the gates
    if layer in d.linear_layers:  # Gated DeltaNet instead of attention (Qwen3-Next / Qwen3.5)
        attn, norms = _gated_delta_net_params(d), 2 * d.hidden + d.linear_value_dim
    if layer in d.moe_layers:
        one_expert = 3 * d.hidden * d.moe_ffn_hidden + (2 * d.moe_ffn_hidden + d.hidden) * d.expert_bias
        shared = 3 * d.hidden * d.shared_expert_ffn
        router = d.hidden * d.num_experts + d.hidden * d.shared_expert_gate + d.num_experts * d.router_bias
        return LayerParams(attn + shared, norms + router, d.num_experts * one_expert, d.topk * one_expert)
    return LayerParams(attn + 3 * d.hidden * d.ffn_hidden, norms, 0, 0)


def _gated_delta_net_params(d: _ModelDims) -> int:
    """One Gated DeltaNet layer's TP-sharded weights: in_proj hidden -> [q, k (Hk*dk each), v, z (Hv*dv each),
    b, a (Hv each)], the depthwise conv over [q, k, v] (K taps), dt_bias and A_log (Hv), out_proj Hv*dv -> hidden."""
    qk, v, hv = d.linear_key_heads * d.linear_key_dim, d.linear_value_heads * d.linear_value_dim, d.linear_value_heads
    return d.hidden * (2 * qk + 2 * v + 2 * hv) + (2 * qk + v) * d.linear_conv_kernel + 2 * hv + v * d.hidden


def gated_delta_net_state_bytes(d: _ModelDims) -> int:
    """Per sequence, all Gated DeltaNet layers: the recurrent state Hv x dk x dv (fp32) and the conv
    history (K - 1) x (2*Hk*dk + Hv*dv) (bf16) that an engine keeps instead of a KV cache."""
    conv = (d.linear_conv_kernel - 1) * (
        2 * d.linear_key_heads * d.linear_key_dim + d.linear_value_heads * d.linear_value_dim
    )
    return len(d.linear_layers) * (4 * d.linear_value_heads * d.linear_key_dim * d.linear_value_dim + 2 * conv)


def _mla_params(d: _ModelDims, te: bool = False) -> tuple[int, int]:
    """Multi-latent attention: (TP-sharded weights, replicated weights) of one layer. q: hidden ->
    q_lora (+ its norm) -> heads * (nope + rope), or hidden -> heads * (nope + rope) directly;
    kv: hidden -> kv_lora + rope (+ norm over kv_lora) -> heads * (nope + v); out: heads * v -> hidden.
    The down projections (hidden -> q_lora, hidden -> kv_lora + rope) count as sharded on the local spec
    (it splits them over TP) and as replicated on Transformer Engine's (``te``: megatron-core builds them
    ``TELinear(parallel_mode="duplicated")``, models/deepseek_v3/te_attention.py)."""
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    down = d.hidden * d.q_lora_rank + d.hidden * (d.kv_lora_rank + d.qk_rope_head_dim)
    q = d.q_lora_rank * d.num_heads * qk if d.q_lora_rank else d.hidden * d.num_heads * qk
    kv = d.kv_lora_rank * d.num_heads * (d.qk_nope_head_dim + d.v_head_dim)
    out = d.num_heads * d.v_head_dim * d.hidden
    norms = 2 * d.hidden + d.q_lora_rank + d.kv_lora_rank
    if te:
        return q + kv + out, norms + down
    return q + kv + out + down, norms


@dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # per token: non-expert params + topk experts per MoE layer
    embedding: int  # input embedding + output layer (once if tied)
    expert: int


def param_counts(d: _ModelDims) -> ParamCounts:
    """Parameter counts computed from the dims (same tensors as the HF checkpoint holds)."""
    layers = [layer_params(d, i) for i in range(d.num_layers)]
    emb = d.vocab_size * d.hidden * (1 if d.tie_embeddings else 2)
    dense = sum(lp.tp_sharded + lp.replicated for lp in layers) + emb + d.hidden  # + final norm
    expert = sum(lp.expert for lp in layers)
    return ParamCounts(dense + expert, dense + sum(lp.active_expert for lp in layers), emb, expert)


@dataclass
class StageMemory:
    """Per-GPU memory of one pipeline stage, in bytes; ``items`` are (label, bytes) rows."""

    stage: int
    layers: tuple[int, int]  # [first, last) global layer ids
    params: int
    train_items: list[tuple[str, float]] = field(default_factory=list)
    rollout_items: list[tuple[str, float]] = field(default_factory=list)
    kv_cache: float = 0.0
    host_optimizer: float = 0.0  # optimizer bytes offloaded to host memory
    host_delta: float = 0.0  # rollout.sync_delta: host copies of the model on the busiest GPU's node share
    host_capture: float = 0.0  # routing replay r3: sglang's pinned capture buffers of one engine process
    in_flight: int = 0  # micro-batches whose activations are held at once (1F1B)

    @property
    def train_peak(self) -> float:
        return sum(b for _, b in self.train_items)

    @property
    def rollout_peak(self) -> float:
        return sum(b for _, b in self.rollout_items)

    @property
    def peak(self) -> float:
        return max(self.train_peak, self.rollout_peak)


@dataclass
class Plan:
    """Everything the planner derived; ``plan_report.format_plan`` prints it."""

    cfg: Config
    dims: _ModelDims
    counts: ParamCounts
    source: str
    nodes: int
    gpus_per_node: int
    gpu_bytes: float
    train_world: int
    engine_gpus: int  # separate GPUs for engines (disaggregated)
    num_engines: int
    dp: int
    edp: int
    micro_batches: int
    stages: list[StageMemory]
    engine_gpu: StageMemory | None  # the memory of one engine GPU (disaggregated)
    kv_per_token: float
    notes: list[str]

    @property
    def worst(self) -> StageMemory:
        return max(self.stages + ([self.engine_gpu] if self.engine_gpu else []), key=lambda s: s.peak)

    @property
    def fits(self) -> bool:
        return self.worst.peak <= self.gpu_bytes and all(
            s.kv_cache > 0 for s in self.stages + [self.engine_gpu] if s is not None and s.rollout_items
        )


def _activation_bytes_per_layer(d: _ModelDims, cfg: Config, layer: int, tokens: float) -> float:
    """Stored activations of one layer for one micro-batch on one GPU (tokens = full micro-batch / cp)."""
    p, act = cfg.parallel, DTYPE_BYTES[cfg.model.dtype]
    assert p.etp is not None, "parallel.etp is resolved when the config is loaded"
    sp = p.tp if p.sequence_parallel else 1  # sequence-parallel regions split tokens over tp
    q, kv = d.q_size, d.kv_size
    per_token = 2 * d.hidden / sp  # attention: norm input + output
    per_token += (q + 2 * kv + q + (q + kv) * d.qk_norm) / p.tp  # q, k, v, core-attention out, q/k norms
    per_token += 2 * d.hidden / sp  # MLP: norm input + output
    if layer in d.moe_layers:
        per_token += 2 * d.num_experts / sp  # fp32 router probabilities
        # dispatched tokens, fc1 out (gate+up), activation out, fc2 out; expert-TP gathers the tokens
        per_token += d.topk * (2 * d.hidden * p.etp + 3 * d.moe_ffn_hidden) / sp
        per_token += 3 * d.shared_expert_ffn / p.tp  # shared expert: fc1 out (gate+up), activation out
    else:
        per_token += 3 * d.ffn_hidden / p.tp
    return per_token * tokens * act


def route_bytes_per_sample(d: _ModelDims, tokens: int) -> int:
    """Routing replay: one sample's routed experts, int32 [tokens - 1, layers, top-k] (the engine
    routes every token but the last; ``rollout/routing.py``): (tokens - 1) x layers x top-k x 4 bytes."""
    return max(tokens - 1, 0) * d.num_layers * d.topk * 4


def indexer_bytes_per_sample(d: _ModelDims, tokens: int) -> int:
    """Routing replay r3 on a DSA model (DeepSeek-V3.2, GLM-5): one sample's indexer selection, int32
    [tokens - 1, layers, index_topk] (sglang's ``meta_info["indexer_topk"]``, ``rollout/routing.py``):
    (tokens - 1) x layers x index_topk x 4 bytes; 0 without an indexer."""
    return max(tokens - 1, 0) * d.num_layers * int(getattr(d, "index_topk", 0) or 0) * 4


def capture_buffer_bytes(d: _ModelDims, cfg: Config, kv_tokens: float, gpu_bytes: float) -> tuple[float, float]:
    """(host, GPU) bytes of the capture buffers ``rollout.routing_replay=r3`` makes every sglang 0.5.23
    engine process (one per engine TP rank) allocate: ``--enable-return-routed-experts`` ->
    ``RoutedExpertsCapturer`` (``state_capturer/routed_experts.py``), and on a DSA model
    ``--enable-return-indexer-topk`` -> ``IndexerTopkCapturer`` (``state_capturer/indexer_topk.py``), each a
    ``BaseTopkCapturer`` (``state_capturer/base.py``) holding int32 buffers of width ``layers x topk``:

    - host (pinned, ``BaseHostCache``): ``num_tokens`` rows, ``num_tokens =
      kv_index_translator.capture_token_capacity(max_token_pool_size) = KV tokens + page_size``
      (``mem_cache/kv_index_translator.py``; page_size 64 on DSA, 1 otherwise: negligible);
    - GPU (``BaseDeviceCache``, outside ``mem_fraction_static``: allocated after the KV pool):
      ``max(chunked_prefill_size, max_running_requests)`` rows (x ``num_dp_ranks`` for the routes: 1,
      the engines run no attention DP); ``chunked_prefill_size`` by GPU memory
      (``arg_groups/memory_hook.py`` ``handle_gpu_memory_settings``: < 20 GiB 2048, < 60 GiB 4096,
      < 160 GiB 8192, else 16384); ``max_running_requests = min(max(min(tokens / context_len * 512,
      4096), 2048), tokens // 2)`` (``mem_cache/kv_cache_configurator.py`` ``resolve_max_num_reqs``,
      context_len: max_position_embeddings);
    - widths: routes ``num_hidden_layers x num_experts_per_tok`` (the GPU buffer also holds fused shared
      experts' columns when sglang fuses them: not counted), indexer ``num_hidden_layers x index_topk``
      (``configs/model_config.py`` ``get_num_indexer_layers``: every layer on DSA)."""
    if cfg.rollout.routing_replay != "r3" or not d.moe_layers:
        return 0.0, 0.0
    index_topk = int(getattr(d, "index_topk", 0) or 0)
    width = d.num_layers * (d.topk + index_topk)
    tokens = int(max(kv_tokens, 0.0))
    mib = gpu_bytes / 2**20
    chunked = 2048 if mib < 20 * 1024 else 4096 if mib < 60 * 1024 else 8192 if mib < 160 * 1024 else 16384
    running = min(max(min(int(tokens / d.max_position_embeddings * 512), 4096), 2048), tokens // 2)
    return float((tokens + (64 if index_topk else 1)) * width * 4), float(max(chunked, running) * width * 4)


def _route_bytes(cfg: Config, d: _ModelDims, dp: int, stage_layers: int) -> tuple[str, float]:
    """The GPU row of ``rollout.routing_replay`` on one rank: the step's DP share of samples, each at
    ``model.max_seq_len`` tokens, cut over CP. r3: the engine's routes of every layer on the step's
    micro-batches (int32, :func:`route_bytes_per_sample`); r2: the old forward's record of this stage's
    layers (int64 [tokens / (cp * sp), top-k] per layer, ``trainer/route_replay.py``)."""
    p = cfg.parallel
    n = cfg.step_batch_size / max(dp, 1)
    if cfg.rollout.routing_replay == "r3":
        return (
            "routing replay r3: engine routes (int32 [tokens - 1, layers, top-k] per sample, step's DP share)",
            n * route_bytes_per_sample(d, cfg.model.max_seq_len) / p.cp,
        )
    sp = p.tp if p.sequence_parallel else 1
    return (
        "routing replay r2: old forward's routes (int64 [tokens, top-k] per stage layer, step's DP share)",
        n * cfg.model.max_seq_len / (p.cp * sp) * stage_layers * d.topk * 8,
    )


def lora_layer_params(d: _ModelDims, layer: int, rank: int) -> tuple[int, int]:
    """(dense, routed-expert) LoRA parameters of one layer, r * (in + out) per adapted linear, with
    ``model.lora.target_modules`` at its default (every attention / MLP / expert linear; the adapters
    counted whole on every TP rank: A or B of each is replicated, an upper bound)."""
    h, r = d.hidden, rank
    if layer in d.linear_layers:
        attn = 0  # linear-attention layers (Gated DeltaNet) have no adapted projection
    elif d.mla:
        qk = d.qk_nope_head_dim + d.qk_rope_head_dim
        q = (h + d.q_lora_rank) + (d.q_lora_rank + d.num_heads * qk) if d.q_lora_rank else h + d.num_heads * qk
        attn = (
            q
            + (h + d.kv_lora_rank + d.qk_rope_head_dim)
            + (d.kv_lora_rank + d.num_heads * (d.qk_nope_head_dim + d.v_head_dim))
            + (d.num_heads * d.v_head_dim + h)
        )
    else:
        attn = (h + (d.num_heads + 2 * d.num_kv_heads) * d.head_dim) + (d.num_heads * d.head_dim + h)

    def mlp(ffn: int) -> int:
        return (h + 2 * ffn) + (ffn + h) if ffn else 0

    if layer in d.moe_layers:
        return r * (attn + mlp(d.shared_expert_ffn)), r * d.num_experts * mlp(d.moe_ffn_hidden)
    return r * (attn + mlp(d.ffn_hidden)), 0


def _stage_memory(plan_args: dict, stage: int) -> StageMemory:
    cfg: Config = plan_args["cfg"]
    d: _ModelDims = plan_args["dims"]
    p, m, r, o = cfg.parallel, cfg.model, cfg.rollout, cfg.optimizer
    assert p.etp is not None, "parallel.etp is resolved when the config is loaded"
    per_stage = d.num_layers // p.pp
    first, last = stage * per_stage, (stage + 1) * per_stage
    te = m.transformer_impl != "local"  # auto: Transformer Engine on the GPUs planned for
    layers = [layer_params(d, i, te) for i in range(first, last)]
    dense = sum(lp.tp_sharded for lp in layers) / p.tp + sum(lp.replicated for lp in layers)
    if stage == 0:
        dense += d.vocab_size * d.hidden / p.tp
    if stage == p.pp - 1:
        dense += d.hidden + (0 if d.tie_embeddings and p.pp == 1 else d.vocab_size * d.hidden / p.tp)
    expert = sum(lp.expert for lp in layers) / (p.ep * p.etp)
    params = dense + expert
    trained_dense, trained_expert = dense, expert
    if m.lora.rank > 0:  # frozen base (weights only); gradients and optimizer state for the adapters
        adapters = [lora_layer_params(d, i, m.lora.rank) for i in range(first, last)]
        trained_dense, trained_expert = sum(a for a, _ in adapters), sum(e for _, e in adapters) / p.ep
    trained = trained_dense + trained_expert
    adapter_weights = trained if m.lora.rank > 0 else 0
    wb = DTYPE_BYTES[m.dtype]
    grad_b = 4 if (p.grad_reduce_in_fp32 or m.dtype == "float32") else wb
    opt_b = 8 + (4 if m.dtype != "float32" else 0)
    dp, edp = plan_args["dp"], plan_args["edp"]
    opt = opt_b * (trained_dense / dp + trained_expert / edp) if p.use_distributed_optimizer else opt_b * trained
    opt_gpu = opt * (1 - o.cpu_offload_fraction)
    s = StageMemory(stage, (first, last), int(params), host_optimizer=opt - opt_gpu)
    precision = "fp32 master+m+v" if m.dtype != "float32" else "fp32 m+v"
    shard = f"/DP {dp}, experts /EDP {edp}" if p.use_distributed_optimizer else "not sharded"
    offl = f", {o.cpu_offload_fraction:.0%} on host" if o.cpu_offload_fraction else ""
    static = [
        (f"weights ({m.dtype})" + (", + LoRA adapters" if adapter_weights else ""), (params + adapter_weights) * wb),
        (f"gradients ({'fp32' if grad_b == 4 else m.dtype} main_grad)", trained * grad_b),
        (f"optimizer ({precision}, {shard}{offl})", opt_gpu),
    ]
    if cfg.gspo.kl_coef > 0:
        static.append(("reference model (frozen copy)", params * wb))
    # tokens of one micro-batch: the packing budget, or micro_batch_size padded rows
    tokens = (p.max_tokens_per_micro_batch or p.micro_batch_size * m.max_seq_len) / p.cp
    in_flight = min(p.pp - stage, plan_args["micro_batches"])
    if m.recompute:
        sp = p.tp if p.sequence_parallel else 1
        inputs = len(layers) * tokens * d.hidden / sp * wb
        one = max(_activation_bytes_per_layer(d, cfg, i, tokens) for i in range(first, last))
        acts, how = in_flight * inputs + one, "recompute"
    else:
        acts = in_flight * sum(_activation_bytes_per_layer(d, cfg, i, tokens) for i in range(first, last))
        how = "no recompute"
    s.in_flight = in_flight
    s.train_items = static + [(f"activations ({how}; pp - stage micro-batches in flight)", acts)]
    if stage == p.pp - 1 and m.fused_logprobs:  # losses/fused_logprobs.py: no [tokens, V/tp] tensor
        s.train_items.append(
            (
                "fused log-prob head (chunks + fp32 grad_W)",
                DEFAULT_CHUNK_BYTES * 3 + d.vocab_size / p.tp * d.hidden * 4 + tokens * d.hidden * wb,
            )
        )
    elif stage == p.pp - 1:
        s.train_items.append(("logits + grad (vocab-parallel)", tokens * d.vocab_size / p.tp * 2 * wb))
    s.train_items.append(("runtime overhead (CUDA context, NCCL, allocator)", RUNTIME_OVERHEAD_GIB * GIB))
    if r.routing_replay != "off":
        s.train_items.append(_route_bytes(cfg, d, plan_args["dp"], per_stage))
    if r.routing_replay == "r3" and d.index_topk:  # DSA: the indexer's selection travels too
        s.train_items.append(
            (
                "routing replay r3: engine indexer selection (int32 [tokens - 1, layers, index_topk] "
                "per sample, step's DP share)",
                cfg.step_batch_size
                / max(plan_args["dp"], 1)
                * indexer_bytes_per_sample(d, cfg.model.max_seq_len)
                / p.cp,
            )
        )
    if sync_mode(r.sync_mode).colocated:  # the engines' rows on the training GPUs
        resident = 0.0 if r.offload_train else sum(b for _, b in static)
        _engine_rows(plan_args, s, resident, "training states" + (" (offloaded)" if r.offload_train else ""))
        s.train_items += _foreign_context_rows(plan_args)  # contexts stay while the engines' memory is released
        if m.lora.rank > 0 and r.lora_sync == "adapter":  # weight_sync/lora_adapter.py
            kept = plan_args["counts"].total * 2 / r.engine_tp
            s.train_items.append(("engine weights kept (lora_sync=adapter: the base is sent once)", kept))
    per = 1 if r.sync_fp8 else 2  # bytes per parameter of the copies: what the engines are sent
    if r.sync_delta and sync_mode(r.sync_mode).colocated:  # weight_sync/delta.py: the trainer's copy on an
        # engine's first rank + the engine TP rank's (delta_loader.py: the dense tensors and 1/engine_ep of the experts)
        c = plan_args["counts"]
        s.host_delta = c.total * per + (c.total - c.expert + c.expert / r.engine_ep) * per
    elif r.sync_delta:  # disaggregated (weight_sync/delta_http.py): each stage source's copy of its share;
        s.host_delta = plan_args["counts"].total * per / p.pp  # the engines' copies are on their own hosts
    return s


def _engine_rows(plan_args: dict, s: StageMemory, resident: float, resident_label: str) -> None:
    """Rollout-phase rows: SGLang fills engine_mem_fraction of the GPU; the KV cache gets the rest."""
    cfg, counts, gpu = plan_args["cfg"], plan_args["counts"], plan_args["gpu_bytes"]
    r = cfg.rollout
    budget = r.engine_mem_fraction * gpu
    weights = counts.total * (1 if r.sync_fp8 else 2) / r.engine_tp
    overhead = RUNTIME_OVERHEAD_GIB * GIB
    lora_pool = 0.0
    if cfg.model.lora.rank > 0 and r.lora_sync == "adapter":  # sglang's LoRA memory pool: max_loras_per_batch
        d = plan_args["dims"]  # (2, weight_sync/lora_adapter.engine_lora_args) adapters at max rank, bf16, whole
        lora_pool = 2 * 2 * sum(sum(lora_layer_params(d, i, cfg.model.lora.rank)) for i in range(d.num_layers))
    s.kv_cache = budget - overhead - resident - weights - lora_pool
    host, device = capture_buffer_bytes(plan_args["dims"], cfg, s.kv_cache / plan_args["kv_per_token"], gpu)
    s.host_capture = host
    s.rollout_items = [
        (resident_label, resident),
        (f"engine weights ({'fp8' if r.sync_fp8 else 'bf16'}, / engine_tp {r.engine_tp})", weights),
        *([("engine LoRA pool (2 adapters, bf16; lora_sync=adapter)", lora_pool)] if lora_pool else []),
        ("runtime overhead (CUDA context, NCCL, allocator)", overhead),
        (f"KV cache (fills to engine_mem_fraction {r.engine_mem_fraction})", max(s.kv_cache, 0.0)),
        *([("routing replay r3: sglang capture buffers (int32 [batch, layers, topk])", device)] if device else []),
        *_foreign_context_rows(plan_args),
    ]


def _foreign_context_rows(plan_args: dict) -> list[tuple[str, float]]:
    """``rollout.sync_owner_direct``: the engine processes of the other GPUs of the node open CUDA IPC
    handles of this GPU's holder buffers (``weight_sync/owner_direct.py``), each creating a CUDA context
    here (:data:`FOREIGN_CONTEXT_GIB`), on top of the engine's budget (made at sync time, after the KV
    cache) and kept through training (``release_memory_occupation`` frees no context). At most one per
    other GPU of the node."""
    cfg = plan_args["cfg"]
    if not (cfg.rollout.sync_owner_direct and sync_mode(cfg.rollout.sync_mode).colocated):
        return []
    others = max(plan_args.get("gpus_per_node", 1) - 1, 0)
    if not others:
        return []
    return [
        (
            f"owner-direct sync: {others} foreign CUDA contexts ({FOREIGN_CONTEXT_GIB} GiB each)",
            others * FOREIGN_CONTEXT_GIB * GIB,
        )
    ]


def make_plan(cfg: Config, nodes: int, gpus_per_node: int, gpu_memory_gib: float) -> Plan:
    """Check ``cfg`` on ``nodes`` x ``gpus_per_node`` GPUs of ``gpu_memory_gib`` GiB and estimate memory.
    Raises ConfigError (the config cannot run on that cluster, naming the field) or PlanError."""
    for name, v in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--gpu-memory-gb", gpu_memory_gib)):
        if v <= 0:
            raise PlanError(f"{name} must be > 0, got {v}")
    r, p = cfg.rollout, cfg.parallel
    launched_apart = sync_mode(r.sync_mode).separate_gpus and not r.engine_urls  # engines on GPUs of their own
    total = nodes * gpus_per_node
    engine_gpus = 0
    if launched_apart:
        engine_gpus = r.num_engines * r.engine_tp
        if engine_gpus >= total:
            raise ConfigError(
                f"rollout.num_engines * rollout.engine_tp = {r.num_engines} * {r.engine_tp} = "
                f"{engine_gpus} engine GPUs leave no training GPU out of {total}"
            )
    train_world = total - engine_gpus
    hf, source = model_hf_config(cfg)
    dims = ModelDims.from_hf_config(hf)
    validate(cfg, train_world)
    validate_model_layout(cfg, hf)
    startup_refusals(cfg, hf)
    counts = param_counts(dims)
    dp = data_parallel_size(cfg, train_world)
    assert p.etp is not None, "parallel.etp is resolved when the config is loaded"
    args: dict[str, Any] = dict(
        cfg=cfg,
        dims=dims,
        counts=counts,
        gpu_bytes=gpu_memory_gib * GIB,
        dp=dp,
        edp=train_world // (p.ep * p.etp * p.pp),
        micro_batches=micro_batches_per_rank(cfg, train_world),
        gpus_per_node=gpus_per_node,
    )
    if dims.mla:  # SGLang caches MLA's latent (kv_lora + rope) per layer, on every TP rank
        kv_per_token = dims.num_layers * (dims.kv_lora_rank + dims.qk_rope_head_dim) * 2
        if dims.index_topk:  # DSA: the indexer's key per token and layer, fp8 + an fp32 scale per 128
            kv_per_token += dims.num_layers * (dims.index_head_dim + 4 * -(-dims.index_head_dim // 128))
            # (sglang's DSATokenToKVPool index_k_with_scale_buffer, mem_cache/memory_pool.py; counted on
            # every layer, shared ones too: conservative)
    else:
        kv_heads = max(1, dims.num_kv_heads // r.engine_tp)  # SGLang replicates KV heads when tp > kv heads
        # K and V, bf16, in the attention layers (Gated DeltaNet layers keep a fixed state per sequence instead)
        kv_per_token = 2 * (dims.num_layers - len(dims.linear_layers)) * kv_heads * dims.head_dim * 2
    args["kv_per_token"] = kv_per_token
    stages = [_stage_memory(args, 0)] + ([_stage_memory(args, p.pp - 1)] if p.pp > 1 else [])
    engine_gpu = None
    if launched_apart:
        engine_gpu = StageMemory(-1, (0, 0), 0)
        _engine_rows(args, engine_gpu, 0.0, "training states (none on engine GPUs)")
    notes = _notes(cfg, dims, args)
    kv_min = min((s.kv_cache for s in stages + [engine_gpu] if s is not None and s.rollout_items), default=None)
    state = gated_delta_net_state_bytes(dims) / r.engine_tp  # the engines' Gated DeltaNet state, per sequence
    if kv_min is not None and 0 < kv_min < r.group_size * (cfg.model.max_seq_len * kv_per_token + state):
        notes.append(
            f"the KV cache holds fewer than group_size={r.group_size} sequences of model.max_seq_len per "
            "engine: generation will be slow (raise rollout.engine_mem_fraction, or offload_train)"
        )
    return Plan(
        cfg,
        dims,
        counts,
        source,
        nodes,
        gpus_per_node,
        gpu_memory_gib * GIB,
        train_world,
        engine_gpus,
        engine_count(cfg, train_world) if r.engine == "sglang" else 1,
        dp,
        args["edp"],
        args["micro_batches"],
        stages,
        engine_gpu,
        kv_per_token,
        notes,
    )


def _notes(cfg: Config, d: _ModelDims, args: dict) -> list[str]:
    p, r = cfg.parallel, cfg.rollout
    notes = []
    if p.pp > 1 and args["micro_batches"] < p.pp:
        notes.append(
            f"only {args['micro_batches']} micro-batch(es) per optimizer step with pp={p.pp}: "
            "large pipeline bubble (raise rollout.prompts_per_step or lower parallel.micro_batch_size)"
        )
    if cfg.model.fp8:
        notes.append("fp8: Transformer Engine's FP8 weight copies and scaling state are not included")
    if sync_mode(r.sync_mode).in_process:
        notes.append(
            f"in-process HF engine: a full model copy ({param_counts(d).total * DTYPE_BYTES[cfg.model.dtype] / GIB:.1f} "
            "GiB) on global rank 0, not included above"
        )
    if r.engine_urls:
        notes.append(f"engines at rollout.engine_urls ({len(r.engine_urls)}) run outside this cluster")
    if r.routing_replay == "r3":
        host = cfg.step_batch_size * route_bytes_per_sample(d, cfg.model.max_seq_len)
        notes.append(
            f"routing replay r3: every rank's host memory holds the step's routes ({cfg.step_batch_size} "
            f"samples x (max_seq_len - 1) x {d.num_layers} layers x top-{d.topk} x 4 B = {host / GIB:.2f} GiB)"
        )
        if getattr(d, "index_topk", 0):
            host = cfg.step_batch_size * indexer_bytes_per_sample(d, cfg.model.max_seq_len)
            notes.append(
                f"routing replay r3 (DSA): every rank's host memory holds the step's indexer selection "
                f"({cfg.step_batch_size} samples x (max_seq_len - 1) x {d.num_layers} layers x "
                f"index_topk {d.index_topk} x 4 B = {host / GIB:.2f} GiB)"
            )
    return notes
