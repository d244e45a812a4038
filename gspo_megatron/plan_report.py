"""The planner's report and command line: ``format_plan`` (the table ``tools/plan.py`` and
``gspo-train --dry-run`` print), the advice when a plan does not fit, and the argument parsing and exit
codes shared by both entry points (0: fits; 1: does not fit in memory; 2: invalid config or layout).
The memory model itself is :mod:`gspo_megatron.planner`."""

from __future__ import annotations

import argparse
import sys

from gspo_megatron.config import load_config
from gspo_megatron.errors import ConfigError
from gspo_megatron.features import enabled_features
from gspo_megatron.features.adapter_sync import ADAPTER_SYNC
from gspo_megatron.features.base import floor2
from gspo_megatron.features.fp8_sync import engine_param_bytes
from gspo_megatron.features.offload import OFFLOAD
from gspo_megatron.features.sync_modes import sync_mode
from gspo_megatron.planner import GIB, Plan, PlanError, make_plan


def _count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _gib(b: float) -> str:
    return f"{b / GIB:8.2f}"


def format_plan(plan: Plan) -> str:
    """The human-readable plan (what tools/plan.py prints)."""
    cfg, d, c = plan.cfg, plan.dims, plan.counts
    p, r = cfg.parallel, cfg.rollout
    out = []
    moe = f", {d.num_experts} experts top-{d.topk} ({len(d.moe_layers)} MoE layers)" if d.num_experts else ""
    out.append(f"model    {d.model_type} from {plan.source}")
    out.append(
        f"         {_count(c.total)} params total, {_count(c.active)} active; {d.num_layers} layers, "
        f"hidden {d.hidden}, {d.num_heads} heads / {d.num_kv_heads} kv heads{moe}"
    )
    total = plan.nodes * plan.gpus_per_node
    sm = sync_mode(r.sync_mode)
    if sm.in_process:
        engines = "in-process HF engine on rank 0"
    elif sm.colocated:
        engines = f"{plan.num_engines} engine(s) x engine_tp {r.engine_tp} on the same GPUs"
    else:
        engines = (
            f"{plan.num_engines} engine(s) x engine_tp {r.engine_tp} on {plan.engine_gpus} separate GPUs"
            if plan.engine_gpus
            else f"{plan.num_engines} external engine(s)"
        )
    out.append(
        f"cluster  {plan.nodes} node(s) x {plan.gpus_per_node} GPUs = {total}, {plan.gpu_bytes / GIB:g} GiB each; "
        f"{plan.train_world} training ranks; rollout: {engines} ({r.sync_mode})"
    )
    out.append(
        f"layout   TP {p.tp}  PP {p.pp}  CP {p.cp}  EP {p.ep}  ETP {p.etp}  DP {plan.dp}  expert-DP {plan.edp}  "
        f"SP {'on' if p.sequence_parallel else 'off'}"
    )
    per_stage = d.num_layers // p.pp
    experts = f"; experts per rank {d.num_experts // p.ep} (of {d.num_experts})" if d.num_experts else ""
    out.append(
        f"         layers per stage {per_stage}{experts}; params per GPU "
        + ", ".join(f"stage {s.stage} {_count(s.params)}" for s in plan.stages)
    )
    g = cfg.gspo
    mini = cfg.step_batch_size // g.mini_batches
    out.append(
        f"batch    {r.prompts_per_step} prompts x G {r.group_size} = {cfg.step_batch_size} sequences/step = "
        f"{g.mini_batches} mini-batch(es) of {mini}; per DP rank {mini // plan.dp} sequences = "
        f"{plan.micro_batches} micro-batch(es) of {p.micro_batch_size} x {cfg.model.max_seq_len} tokens"
    )
    out.append("")
    cols = [s for s in plan.stages] + ([plan.engine_gpu] if plan.engine_gpu else [])
    names = [f"stage {s.stage}" if s.stage >= 0 else "engine GPU" for s in cols]
    out.append(f"{'memory per GPU (GiB)':<69}" + "".join(f"{n:>12}" for n in names))

    def rows(title: str, attr: str, peak: str) -> None:
        labels: list[str] = []
        for s in sorted(cols, key=lambda s: -len(getattr(s, attr))):  # the last stage has every row
            for lbl, _ in getattr(s, attr):
                if lbl not in labels:
                    labels.append(lbl)
        if not labels:
            return
        out.append(f" {title}")
        for lbl in labels:
            vals = [dict(getattr(s, attr)).get(lbl) for s in cols]
            out.append(f"   {lbl[:66]:<66}" + "".join(f"{'-':>12}" if v is None else f"{_gib(v):>12}" for v in vals))
        out.append(
            f"   {'= peak':<66}"
            + "".join(f"{_gib(getattr(s, peak)):>12}" if getattr(s, attr) else f"{'-':>12}" for s in cols)
        )

    kept = ADAPTER_SYNC.enabled(cfg)  # the engines keep their weights (features/adapter_sync.py)
    rows("training phase" + (" (engines released)" if sm.colocated and not kept else ""), "train_items", "train_peak")
    rows("rollout phase (engines generating)", "rollout_items", "rollout_peak")
    if p.pp > 1:
        out.append("   micro-batches in flight: " + ", ".join(f"stage {s.stage}: {s.in_flight}" for s in plan.stages))
    host = max(s.host_optimizer for s in cols)
    if host:
        out.append(f"   host memory per GPU for offloaded optimizer states: {host / GIB:.2f} GiB")
    pinned = max(s.host_offload for s in cols)
    if pinned:
        out.append(f"   pinned host memory per GPU for rollout.offload_train's training state: {pinned / GIB:.2f} GiB")
    delta = max(s.host_delta for s in cols)
    if delta and sm.colocated:
        out.append(
            f"   host memory per GPU for rollout.sync_delta's copies of the model ({'FP8' if engine_param_bytes(cfg) == 1 else 'bf16'}; "
            "the engine TP rank's: its dense tensors and its EP rank's experts, and the trainer's on each "
            f"engine's first GPU): up to {delta / GIB:.2f} GiB"
        )
    elif delta:
        out.append(
            f"   host memory for rollout.sync_delta's copy of a stage's weights on its source GPU: {delta / GIB:.2f} GiB "
            f"(bf16; each engine host keeps {plan.counts.total * 2 / GIB:.2f} GiB per engine TP rank)"
        )
    capture = max(s.host_capture for s in cols)
    if capture:  # features.routing_replay.capture_buffer_bytes: sglang's pinned [KV tokens, layers, topk] int32 buffers
        out.append(
            f"   host memory per engine GPU (process) for routing replay r3's sglang capture buffers "
            f"(pinned int32 [KV tokens, layers, topk]): {capture / GIB:.2f} GiB"
        )
    if not sm.in_process and plan.kv_per_token:  # SGLang engines: a KV cache
        kv = min(s.kv_cache for s in cols if s.rollout_items) if any(s.rollout_items for s in cols) else 0.0
        if kv > 0:
            tokens = kv / plan.kv_per_token
            out.append(
                f"   KV cache per engine: {tokens / 1e3:,.0f}k tokens = {tokens / cfg.model.max_seq_len:,.0f} "
                f"sequences of {cfg.model.max_seq_len} tokens ({plan.kv_per_token / 1024:.0f} KiB/token per GPU)"
            )
    out.append("")
    w = plan.worst
    name = f"stage {w.stage}" if w.stage >= 0 else "engine GPU"
    head = plan.gpu_bytes - w.peak
    out.append(
        f"peak {w.peak / GIB:.2f} GiB ({name}) of {plan.gpu_bytes / GIB:g} GiB: headroom {head / GIB:.2f} GiB "
        f"({head / plan.gpu_bytes:.0%})" + ("" if plan.fits else "  -> DOES NOT FIT")
    )
    for n in plan.notes:
        out.append(f"note: {n}")
    if not plan.fits:
        out.append("does not fit: " + _advice(plan))
    return "\n".join(out)


def _advice(plan: Plan) -> str:
    cfg = plan.cfg
    tips = []
    offload_helps = sync_mode(cfg.rollout.sync_mode).colocated and not OFFLOAD.enabled(cfg)
    kv_full = any(s.rollout_items and s.kv_cache <= 0 for s in plan.stages + [plan.engine_gpu] if s)
    if kv_full:
        tips.append(
            "no room for the KV cache: raise rollout.engine_mem_fraction or rollout.engine_tp"
            + (", or set rollout.offload_train=true" if offload_helps else "")
        )
    over = max((s.rollout_peak - plan.gpu_bytes for s in plan.stages if s.rollout_items), default=0.0)
    if over > 0:  # the rollout phase: the engines' share, a started teacher's, what stays resident
        frac = over / plan.gpu_bytes
        r = cfg.rollout
        if r.engine_mem_fraction - frac > 0:
            tips.append(f"rollout.engine_mem_fraction <= {floor2(r.engine_mem_fraction - frac)}")
        tips += [t for f in enabled_features(cfg) for t in f.rollout_advice(cfg, frac)]
        if offload_helps and not kv_full:  # (the KV cache tip already names it)
            tips.append("rollout.offload_train=true")
    if plan.worst.train_peak > plan.gpu_bytes:
        if not cfg.model.recompute:
            tips.append("model.recompute=true")
        tips.append("raise parallel.ep / parallel.pp / parallel.tp")
        if cfg.optimizer.cpu_offload_fraction < 1:
            tips.append("optimizer.cpu_offload_fraction")
        tips.append("lower parallel.micro_batch_size or model.max_seq_len")
    return "; ".join(tips)


def build_arg_parser(prog: str = "plan.py") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Check a gspo-megatron config against a cluster shape "
        "and estimate per-GPU memory. Exit 0: fits; 1: does not fit in memory; "
        "2: invalid config or layout.",
    )
    ap.add_argument("--config", help="YAML config (default: built-in defaults)")
    add_cluster_args(ap)
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return ap


def add_cluster_args(ap: argparse.ArgumentParser) -> None:
    """--nodes / --gpus-per-node / --gpu-memory-gb (shared with gspo-train --dry-run)."""
    ap.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU in GiB (default 80)")


def run_plan(
    config: str | None,
    overrides: list[str],
    nodes: int,
    gpus_per_node: int,
    gpu_memory_gb: float,
    out=None,
    prog: str = "plan.py",
) -> int:
    """Load (without checking that files exist), plan, print; return the exit code (0/1/2). A bad
    config is one line ``<prog>: error: ...`` (on stderr, or on ``out`` when given)."""
    from gspo_megatron.errors import one_line

    err = out or sys.stderr
    out = out or sys.stdout
    try:
        cfg = load_config(config, overrides, check_files=False)
        plan = make_plan(cfg, nodes, gpus_per_node, gpu_memory_gb)
    except (ConfigError, PlanError) as e:
        print(f"{prog}: error: {one_line(e)}", file=err)
        return 2
    print(format_plan(plan), file=out)
    return 0 if plan.fits else 1


def plan_main(argv: list[str] | None = None) -> int:
    """Entry point of tools/plan.py; returns the exit code."""
    a = build_arg_parser().parse_args(argv)
    return run_plan(a.config, a.overrides, a.nodes, a.gpus_per_node, a.gpu_memory_gb)
