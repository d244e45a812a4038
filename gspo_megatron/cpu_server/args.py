"""Command line of the CPU server: the subset of ``python -m sglang.launch_server``'s flags that the
project passes (``engines.sglang_engine.launch`` / ``server_args_to_cli``), same names and
meanings. Unknown flags are refused by argparse (exit code 2, one line naming the flag), as
sglang's own parser does. GPU-only flags are accepted and recorded (``--base-gpu-id``,
``--mem-fraction-static``, ``--disable-radix-cache``: there is no radix cache here) so that the same command line starts either server.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Sequence

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
#: the default of --router-logit-perturbation (a test sets it for the servers a training run launches)
PERTURBATION_ENV = "GSPO_CPU_SERVER_ROUTER_PERTURBATION"


@dataclass
class ServerArgs:
    """Parsed flags (field names as sglang's ``ServerArgs``)."""

    model_path: str
    host: str
    port: int
    tp_size: int
    ep_size: int
    base_gpu_id: int
    nnodes: int
    node_rank: int
    dist_init_addr: str | None
    enable_memory_saver: bool
    enable_weights_cpu_backup: bool
    skip_server_warmup: bool
    mem_fraction_static: float | None
    random_seed: int
    enable_deterministic_inference: bool
    dtype: str
    load_format: str
    log_level: str
    sglang_loader_check: str = "auto"
    enable_return_routed_experts: bool = False
    enable_return_indexer_topk: bool = False
    router_logit_perturbation: float = 0.0
    custom_weight_loader: list[str] | None = None
    # LoRA (sglang's flags; cpu_server/lora.py)
    enable_lora: bool | None = None
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None
    max_loaded_loras: int | None = None
    max_loras_per_batch: int = 8
    dp_size: int = 1
    # sglang's --max-running-requests (arg_groups/fields/schedule.py): the scheduler admits no more requests
    # at once; None = no limit here (sglang's own default comes from its KV pool, at least 2048 where memory
    # allows: mem_cache/kv_cache_configurator.py resolve_max_num_reqs); 48 with speculative decoding
    max_running_requests: int | None = None
    # recorded: the CPU server has no radix cache, so it serves as sglang does with the flag set
    disable_radix_cache: bool = False
    # speculative decoding with the checkpoint's MTP layer (sglang's flags, resolved as sglang resolves them:
    # cpu_server/speculative.py)
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None

    @property
    def tp_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def local_tp_ranks(self) -> list[int]:
        """The TP ranks this node starts: ``[node_rank * tp/nnodes, (node_rank + 1) * tp/nnodes)``."""
        k = self.tp_per_node
        return list(range(self.node_rank * k, (self.node_rank + 1) * k))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gspo_megatron.cpu_server",
        description="CPU stand-in for `python -m sglang.launch_server` (SGLang 0.5.23 HTTP API) that lets CI "
        "run the GPU wiring; not an inference server.",
    )
    p.add_argument(
        "--model-path",
        "--model",
        dest="model_path",
        required=True,
        help="HF model directory (config.json; *.safetensors unless --load-format dummy)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--ep-size", "--expert-parallel-size", dest="ep_size", type=int, default=1)
    p.add_argument("--base-gpu-id", type=int, default=0, help="accepted, ignored on CPU")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument(
        "--dist-init-addr", default=None, help="host:port of the engine's TP rendezvous (required with --nnodes > 1)"
    )
    p.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="release/resume_memory_occupation free and restore weights (without it they are no-ops)",
    )
    p.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="a weights release keeps a host copy and the resume restores it (sglang's "
        "arg_groups/fields/exec_.py; without it a resumed engine holds zeros until the next sync)",
    )
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--disable-radix-cache", action="store_true", help="accepted and recorded (no radix cache here)")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="accepted and recorded")
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="honour per-request sampling_seed (sglang ignores it otherwise)",
    )
    p.add_argument("--dtype", default="auto", choices=DTYPES)
    p.add_argument(
        "--load-format",
        default="auto",
        choices=LOAD_FORMATS,
        help="dummy: random weights (they come by a weight update)",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        help="requests the scheduler runs at once (sglang's flag); default: no limit (sglang's comes from its KV "
        "cache), 48 with --speculative-algorithm (sglang's _handle_eagle_family)",
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="requests with return_routed_experts get meta_info['routed_experts'] (sglang's base64 int32 "
        "[tokens, layers, topk] over [routed_experts_start_len, seqlen - 1))",
    )
    p.add_argument(
        "--enable-return-indexer-topk",
        action="store_true",
        help="DSA models: requests with return_indexer_topk get meta_info['indexer_topk'] (sglang's base64 "
        "int32 [seqlen - 1, layers, index_topk] of key positions, -1 where fewer keys exist)",
    )
    p.add_argument(
        "--router-logit-perturbation",
        type=float,
        default=float(os.environ.get(PERTURBATION_ENV) or 0.0),
        help="not sglang's (CPU server only): choose the MoE experts from the router logits plus SCALE * "
        "(h @ P_layer), a fixed random [H, E] matrix per layer, so the engine routes unlike the trainer "
        f"(cpu_server/routes.py); default: ${PERTURBATION_ENV} or 0 (how a training run's tests set it)",
    )
    p.add_argument(
        "--custom-weight-loader",
        nargs="*",
        default=None,
        help="dotted names of weight loaders update_weights_from_tensor may name as its load_format "
        "(sglang's flag; e.g. gspo_megatron.weight_sync.delta_loader.apply_deltas)",
    )
    p.add_argument(
        "--sglang-loader-check",
        default="auto",
        choices=("auto", "on", "off"),
        help="not sglang's (CPU server only): each TP rank also holds sglang's own model class, loads "
        "every bucket with its load_weights and fails a weight update that leaves a parameter "
        "unwritten (cpu_server/sglang_models.py); auto: on when sglang imports",
    )
    from gspo_megatron.cpu_server.lora import add_lora_args
    from gspo_megatron.cpu_server.speculative import add_speculative_args

    add_lora_args(p)
    add_speculative_args(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    """Parse and check; errors exit with argparse's one-line message (code 2)."""
    p = build_parser()
    ns = p.parse_args(argv)
    if ns.tp_size < 1:
        p.error(f"--tp-size must be >= 1, got {ns.tp_size}")
    if ns.ep_size < 1 or ns.tp_size % ns.ep_size:
        p.error(f"--ep-size {ns.ep_size} must divide --tp-size {ns.tp_size}")
    if ns.nnodes < 1 or ns.tp_size % ns.nnodes:
        p.error(f"--nnodes {ns.nnodes} must divide --tp-size {ns.tp_size}")
    if not 0 <= ns.node_rank < ns.nnodes:
        p.error(f"--node-rank {ns.node_rank} must be in [0, {ns.nnodes})")
    if ns.nnodes > 1 and not ns.dist_init_addr:
        p.error("--dist-init-addr host:port is required with --nnodes > 1")
    if ns.dist_init_addr and ":" not in ns.dist_init_addr:
        p.error(f"--dist-init-addr must be host:port, got {ns.dist_init_addr!r}")
    if ns.random_seed is None:
        ns.random_seed = 0
    from gspo_megatron.cpu_server.lora import check_lora_args

    check_lora_args(p, ns)
    from gspo_megatron.cpu_server.speculative import resolve_args

    resolve_args(ns, p.error)
    return ServerArgs(**vars(ns))
