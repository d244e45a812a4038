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
from gspo_megatron.features import PlanContext, enabled_features
from gspo_megatron.features.fp8_sync import engine_param_bytes
from gspo_megatron.features.offload import OFFLOAD
from gspo_megatron.features.sync_modes import sync_mode
from gspo_megatron.fleet.engine_startup_checks import startup_refusals
from gspo_megatron.losses.chunking import DEFAULT_CHUNK_BYTES
from gspo_megatron.models.arch import model_hf_config
from gspo_megatron.models.carried import mtp_layers
from gspo_megatron.models.dims import ModelDims as _ModelDims

GIB = 1 << 30
RUNTIME_OVERHEAD_GIB = 4.0


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
    host_offload: float = 0.0  # rollout.offload_train: the pinned host copy of the training state
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


def mtp_like_layer(d: _ModelDims) -> int:
    """The decoder layer an MTP layer has the shape of: the last one, or in a hybrid model (Qwen3-Next /
    Qwen3.5) the last full-attention one (its MTP layer's attention is full)."""
    return max((i for i in range(d.num_layers) if i not in d.linear_layers), default=d.num_layers - 1)


def mtp_layer_params(d: _ModelDims) -> float:
    """Parameters of one MTP layer, whole model: its decoder layer (every routed expert), ``eh_proj`` [H, 2H]
    and the ``enorm`` / ``hnorm`` / final norms (the embedding and head are shared with the model)."""
    lp = layer_params(d, mtp_like_layer(d))
    return float(lp.tp_sharded + lp.replicated + lp.expert + 2 * d.hidden * d.hidden + 3 * d.hidden)


def _stage_memory(plan_args: dict, stage: int) -> StageMemory:
    cfg: Config = plan_args["cfg"]
    d: _ModelDims = plan_args["dims"]
    p, m, o = cfg.parallel, cfg.model, cfg.optimizer
    assert p.etp is not None, "parallel.etp is resolved when the config is loaded"
    per_stage = d.num_layers // p.pp
    first, last = stage * per_stage, (stage + 1) * per_stage
    te = m.transformer_impl != "local"  # auto: Transformer Engine on the GPUs planned for
    # model.mtp: megatron builds each MTP layer on the last stage from the last decoder layer's spec, with full
    # attention in a hybrid model (Qwen3-Next / Qwen3.5: the last full-attention layer's shape)
    mtp = plan_args.get("mtp_layers", 0) if stage == p.pp - 1 else 0
    held = list(range(first, last)) + [mtp_like_layer(d)] * mtp  # the layers this stage holds, as dims' layers
    layers = [layer_params(d, i, te) for i in held]
    dense = sum(lp.tp_sharded for lp in layers) / p.tp + sum(lp.replicated for lp in layers)
    dense += mtp * (2 * d.hidden * d.hidden / p.tp + 3 * d.hidden)  # eh_proj; enorm, hnorm, final norm
    if stage == 0 or (mtp and p.pp > 1):  # the MTP stage's own copy of the embedding (models/mtp.py)
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
    if OFFLOAD.enabled(cfg):  # trainer/offload.py moves weights, gradients and optimizer (not the reference)
        s.host_offload = sum(b for _, b in static)
    if cfg.gspo.kl_coef > 0:
        static.append(("reference model (frozen copy)", params * wb))
    # tokens of one micro-batch: the packing budget, or micro_batch_size padded rows
    tokens = (p.max_tokens_per_micro_batch or p.micro_batch_size * m.max_seq_len) / p.cp
    in_flight = min(p.pp - stage, plan_args["micro_batches"])
    if m.recompute:
        sp = p.tp if p.sequence_parallel else 1
        inputs = len(layers) * tokens * d.hidden / sp * wb
        one = max(_activation_bytes_per_layer(d, cfg, i, tokens) for i in held)
        acts, how = in_flight * inputs + one, "recompute"
    else:
        acts = in_flight * sum(_activation_bytes_per_layer(d, cfg, i, tokens) for i in held)
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
    ctx = _plan_context(plan_args, per_stage, stage=stage)
    for f in enabled_features(cfg):  # routing replay's routes, owner-direct's contexts, adapter sync's kept weights
        s.train_items += f.train_rows(ctx)
    if ctx.colocated:  # the engines' rows on the training GPUs
        resident = sum(b for _, b in static) - s.host_offload  # offloaded: the reference model stays
        _engine_rows(plan_args, s, resident, OFFLOAD.resident_label(cfg), ctx)
    for f in enabled_features(cfg):
        s.host_delta += f.host_bytes(ctx, 0.0).get("delta", 0.0)
    return s


def _plan_context(plan_args: dict, stage_layers: int, engine_gpu: bool = False, stage: int = 0) -> PlanContext:
    """What the components (``features/``) are told of the GPU planned (``features.base.PlanContext``)."""
    cfg, d = plan_args["cfg"], plan_args["dims"]
    rank = cfg.model.lora.rank
    return PlanContext(
        cfg=cfg,
        dims=d,
        counts=plan_args["counts"],
        dp=plan_args["dp"],
        gpu_bytes=plan_args["gpu_bytes"],
        gpus_per_node=plan_args.get("gpus_per_node", 1),
        stage_layers=stage_layers,
        colocated=sync_mode(cfg.rollout.sync_mode).colocated,
        engine_gpu=engine_gpu,
        adapter_params=sum(sum(lora_layer_params(d, i, rank)) for i in range(d.num_layers)) if rank > 0 else 0,
        stage=stage,
        mtp_layers=plan_args.get("checkpoint_mtp_layers", 0),
        mtp_layer_params=mtp_layer_params(d),
        kv_bytes_per_layer=plan_args.get("kv_per_layer", 0.0),
    )


def _engine_rows(plan_args: dict, s: StageMemory, resident: float, resident_label: str, ctx: PlanContext) -> None:
    """Rollout-phase rows: SGLang fills engine_mem_fraction of the GPU; the enabled components' rows inside
    that budget (e.g. a LoRA pool) come off it, the KV cache gets the rest, and their rows beyond it
    (capture buffers, foreign contexts) follow."""
    cfg, counts, gpu = plan_args["cfg"], plan_args["counts"], plan_args["gpu_bytes"]
    r = cfg.rollout
    budget = r.engine_mem_fraction * gpu
    per = engine_param_bytes(cfg)
    weights = counts.total * per / r.engine_tp
    overhead = RUNTIME_OVERHEAD_GIB * GIB
    features = enabled_features(cfg)
    inside = [row for f in features for row in f.engine_budget_rows(ctx)]
    s.kv_cache = budget - overhead - resident - weights - sum(b for _, b in inside)
    kv_tokens = s.kv_cache / plan_args["kv_per_token"]
    s.host_capture = sum(f.host_bytes(ctx, kv_tokens).get("capture", 0.0) for f in features)
    s.rollout_items = [
        (resident_label, resident),
        (f"engine weights ({'fp8' if per == 1 else 'bf16'}, / engine_tp {r.engine_tp})", weights),
        *inside,
        ("runtime overhead (CUDA context, NCCL, allocator)", overhead),
        (f"KV cache (fills to engine_mem_fraction {r.engine_mem_fraction})", max(s.kv_cache, 0.0)),
        *[row for f in features for row in f.rollout_rows(ctx, kv_tokens)],
    ]


def kv_layer_bytes(d: _ModelDims, engine_tp: int) -> tuple[float, int]:
    """(bytes one attention layer keeps per token of an engine's KV cache on one GPU, the attention layers).
    MLA: SGLang caches the latent (kv_lora + rope, bf16) on every TP rank, and on DSA models the indexer's
    key (fp8 + an fp32 scale per 128; sglang's ``DSATokenToKVPool`` ``index_k_with_scale_buffer``,
    ``mem_cache/memory_pool.py``; counted on every layer, shared ones too: conservative). Otherwise K and
    V (bf16) of the KV heads on the GPU (SGLang replicates KV heads when tp > KV heads), in the attention
    layers only (Gated DeltaNet layers keep a fixed state per sequence instead)."""
    if d.mla:
        per = (d.kv_lora_rank + d.qk_rope_head_dim) * 2
        if d.index_topk:
            per += d.index_head_dim + 4 * -(-d.index_head_dim // 128)
        return float(per), d.num_layers
    kv_heads = max(1, d.num_kv_heads // engine_tp)
    return float(2 * kv_heads * d.head_dim * 2), d.num_layers - len(d.linear_layers)


def _mtp_layers_trained(cfg: Config, hf: dict) -> int:
    """The MTP layers the trained model holds (``model.mtp``: the checkpoint's, ``models/carried.py``)."""
    return mtp_layers(hf) if cfg.mtp_in_model else 0


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
        mtp_layers=_mtp_layers_trained(cfg, hf),
    )
    per_layer, attention_layers = kv_layer_bytes(dims, r.engine_tp)
    args["kv_per_layer"] = per_layer
    args["checkpoint_mtp_layers"] = mtp_layers(hf)
    ctx = _plan_context(args, dims.num_layers // p.pp)  # what the components add per token (a draft's layers)
    kv_per_token = per_layer * attention_layers + sum(f.engine_kv_bytes_per_token(ctx) for f in enabled_features(cfg))
    args["kv_per_token"] = kv_per_token
    stages = [_stage_memory(args, 0)] + ([_stage_memory(args, p.pp - 1)] if p.pp > 1 else [])
    engine_gpu = None
    if launched_apart:
        engine_gpu = StageMemory(-1, (0, 0), 0)
        ctx = _plan_context(args, dims.num_layers // p.pp, engine_gpu=True)
        _engine_rows(args, engine_gpu, 0.0, "training states (none on engine GPUs)", ctx)
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
    ctx = _plan_context(args, d.num_layers // p.pp)
    for f in enabled_features(cfg):
        notes += f.notes(ctx)
    return notes
