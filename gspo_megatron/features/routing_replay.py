"""``rollout.routing_replay``: the training forwards route every token to the experts that chose it
when it was sampled. ``r3``: the engines return each token's routed experts (sglang's
``--enable-return-routed-experts``; on a DSA model the indexer's top-k too), decoded and laid on the rows
(``engines/routing.py``, ``trainer/packing.lay_routes``) and replayed by Megatron's routers
(``trainer/route_replay.py``); ``r2``: the old-log-prob forward records its routes and the policy's
forwards replay them."""

from __future__ import annotations

from typing import Any

from gspo_megatron.features.base import GIB, EngineFlag, Feature, PlanContext, Row


def route_bytes_per_sample(d: Any, tokens: int) -> int:
    """Routing replay: one sample's routed experts, int32 [tokens - 1, layers, top-k] (the engine
    routes every token but the last; ``engines/routing.py``): (tokens - 1) x layers x top-k x 4 bytes."""
    return max(tokens - 1, 0) * d.num_layers * d.topk * 4


def indexer_bytes_per_sample(d: Any, tokens: int) -> int:
    """Routing replay r3 on a DSA model (DeepSeek-V3.2, GLM-5): one sample's indexer selection, int32
    [tokens - 1, layers, index_topk] (sglang's ``meta_info["indexer_topk"]``, ``engines/routing.py``):
    (tokens - 1) x layers x index_topk x 4 bytes; 0 without an indexer."""
    return max(tokens - 1, 0) * d.num_layers * int(getattr(d, "index_topk", 0) or 0) * 4


def capture_buffer_bytes(d: Any, cfg, kv_tokens: float, gpu_bytes: float) -> tuple[float, float]:
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


def _route_bytes(cfg, d: Any, dp: int, stage_layers: int) -> tuple[str, float]:
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


class RoutingReplay(Feature):
    name = "routing_replay"
    field = "rollout.routing_replay"
    metrics = ("rollout/route_agreement", "rollout/indexer_agreement")
    flags = {
        "enable_return_routed_experts": EngineFlag("rollout.routing_replay=r3"),
        "enable_return_indexer_topk": EngineFlag("rollout.routing_replay=r3 (a DSA model: the indexer's selection)"),
    }

    def enabled(self, cfg) -> bool:
        return cfg.rollout.routing_replay != "off"

    def returns_routes(self, cfg) -> bool:
        """r3: the engines return each token's routed experts (the rollout carries them to the trainer)."""
        return cfg.rollout.routing_replay == "r3"

    def config_errors(self, cfg) -> list[str]:
        r = cfg.rollout
        if r.routing_replay != "r3" or r.engine == "sglang":
            return []
        return [
            "rollout.routing_replay=r3 needs rollout.engine=sglang (the engines must return their routed experts; "
            "rollout.engine_server=cpu on CPU); the in-process hf engine does not (use r2 or off)"
        ]

    def model_errors(self, cfg, dims: Any) -> list[str]:
        if dims.moe_layers:
            return []
        r = cfg.rollout.routing_replay
        return [f"rollout.routing_replay={r} needs an MoE model; this one is dense (no routed experts)"]

    def engine_args(self, cfg, hf: dict | None, route_spec: Any) -> dict[str, Any]:
        if cfg.rollout.routing_replay != "r3":
            return {}
        args: dict[str, Any] = {"enable_return_routed_experts": True}
        if route_spec is None and hf is not None:
            from gspo_megatron.engines.routing import route_spec_of

            route_spec = route_spec_of(hf)
        if route_spec is not None and route_spec.index_topk:
            args["enable_return_indexer_topk"] = True
        return args

    def engine_env(self, args: dict[str, Any]) -> dict[str, str]:
        """sglang's DSA indexer ids as sequence positions, not KV-pool slots (``SGLANG_DSA_FUSE_TOPK=0``;
        ``engines/routing.py``)."""
        return {"SGLANG_DSA_FUSE_TOPK": "0"} if args.get("enable_return_indexer_topk") else {}

    def train_rows(self, ctx: PlanContext) -> list[Row]:
        cfg, d = ctx.cfg, ctx.dims
        rows = [_route_bytes(cfg, d, ctx.dp, ctx.stage_layers)]
        if cfg.rollout.routing_replay == "r3" and d.index_topk:  # DSA: the indexer's selection travels too
            rows.append(
                (
                    "routing replay r3: engine indexer selection (int32 [tokens - 1, layers, index_topk] "
                    "per sample, step's DP share)",
                    cfg.step_batch_size
                    / max(ctx.dp, 1)
                    * indexer_bytes_per_sample(d, cfg.model.max_seq_len)
                    / cfg.parallel.cp,
                )
            )
        return rows

    def rollout_rows(self, ctx: PlanContext, kv_tokens: float) -> list[Row]:
        _, device = capture_buffer_bytes(ctx.dims, ctx.cfg, kv_tokens, ctx.gpu_bytes)
        return [("routing replay r3: sglang capture buffers (int32 [batch, layers, topk])", device)] if device else []

    def host_bytes(self, ctx: PlanContext, kv_tokens: float) -> dict[str, float]:
        host, _ = capture_buffer_bytes(ctx.dims, ctx.cfg, kv_tokens, ctx.gpu_bytes)
        return {"capture": host} if host else {}

    def notes(self, ctx: PlanContext) -> list[str]:
        cfg, d = ctx.cfg, ctx.dims
        if cfg.rollout.routing_replay != "r3":
            return []
        host = cfg.step_batch_size * route_bytes_per_sample(d, cfg.model.max_seq_len)
        notes = [
            f"routing replay r3: every rank's host memory holds the step's routes ({cfg.step_batch_size} "
            f"samples x (max_seq_len - 1) x {d.num_layers} layers x top-{d.topk} x 4 B = {host / GIB:.2f} GiB)"
        ]
        if getattr(d, "index_topk", 0):
            host = cfg.step_batch_size * indexer_bytes_per_sample(d, cfg.model.max_seq_len)
            notes.append(
                f"routing replay r3 (DSA): every rank's host memory holds the step's indexer selection "
                f"({cfg.step_batch_size} samples x (max_seq_len - 1) x {d.num_layers} layers x "
                f"index_topk {d.index_topk} x 4 B = {host / GIB:.2f} GiB)"
            )
        return notes


ROUTING_REPLAY = RoutingReplay()
