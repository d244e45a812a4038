"""Weight-sync bytes and modelled seconds of the shipped recipes: the model (formulas, routings,
``LinkLoad``) is bench/sync_model.py's; this module reads each recipe's layout (``recipe_layout``)
and prints the tables. Used by bench/weight_sync.py (``--part bytes``: bytes each training rank,
engine GPU and node sends per sync, ``table``); tests/weight_sync/test_sync_bytes.py checks the
model against the real export plan and the owner-direct routing, so these numbers follow the code.

Sync-time model (issue 23; ``python bench/sync_bytes.py [recipe ...] [--nvlink-gbps 450] [--ib-gbps 50]
[--nics-per-node 8] [--pcie-gbps 55] [--delta-fractions 0.0179,0.0005] [--engine-ep N] [--bytes]``): each shipped
recipe's bytes per link turned into seconds on a stated H100 / H200 cluster, for full (built),
owner-direct as built (colocated only: ``rollout.sync_owner_direct``, weight_sync/owner_direct.py),
owner-direct as designed, delta as built (colocated: weight_sync/cuda_ipc.py; disaggregated:
weight_sync/delta_http.py) and delta from the owners (designed), colocated and disaggregated;
t = max over (GPU, link, direction) of bytes / bandwidth (``LinkLoad``). Modelled, not measured;
assumptions in ``assumptions()`` (printed) and docs/bench.md.
"""

from __future__ import annotations

import os
import re
import sys
from collections import defaultdict
from dataclasses import replace

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # sync_model beside it (also when the tests load this file by path)

from sync_model import (  # noqa: E402  (re-exported: the tests and bench/weight_sync.py use them from here)
    GB,
    Cluster,
    Layout,
    LinkLoad,
    StageBytes,
    built_expert_routes,
    delta_as_built_load,
    delta_http_load,
    delta_owner_load,
    delta_ratio,
    delta_wire_bytes,
    engine_gpus,
    expert_holders,
    full_sync_load,
    node_egress,
    owner_bytes,
    owner_direct_built_load,
    owner_direct_load,
    source_bytes,
    stage_bytes,
    traffic,
    transfer_seconds,
)

__all__ = [
    "GB",
    "Cluster",
    "Layout",
    "LinkLoad",
    "StageBytes",
    "assumptions",
    "built_expert_routes",
    "delta_as_built_load",
    "delta_http_load",
    "delta_owner_load",
    "delta_ratio",
    "delta_wire_bytes",
    "engine_gpus",
    "expert_holders",
    "fp8_stage_bytes",
    "full_sync_load",
    "main",
    "node_egress",
    "owner_bytes",
    "owner_direct_built_load",
    "owner_direct_load",
    "planner_header",
    "recipe_layout",
    "recipe_paths",
    "roles",
    "source_bytes",
    "stage_bytes",
    "table",
    "time_rows",
    "time_table",
    "traffic",
    "transfer_seconds",
]


def fp8_stage_bytes(dims, stages: list[StageBytes], dtype_bytes: int) -> list[StageBytes]:
    """Approximate wire bytes after ``rollout.sync_fp8`` (weight_sync/fp8_quant.py): expert and
    attention / dense-MLP projections at 1 byte per element plus a float32 scale per 128 x 128
    block (4 / 16384 bytes per element); embedding, lm_head, norms, routers (R) in the model dtype.
    The few small tensors a family excludes (fp8_excluded) are counted as quantized."""
    out, last = [], len(stages) - 1
    for s, sb in enumerate(stages):
        keep = (dims.vocab_size * dims.hidden * dtype_bytes if s == 0 else 0) + (
            dims.vocab_size * dims.hidden * dtype_bytes if s == last and not dims.tie_embeddings else 0
        )
        q = lambda b: round(b / dtype_bytes * (1 + 4 / 16384))
        out.append(StageBytes(q(sb.tp_sharded - keep) + keep, sb.replicated, q(sb.expert)))
    return out


def recipe_layout(config_path: str, nodes: int, gpus_per_node: int = 8) -> tuple[Layout, object, int]:
    """(Layout, planner.ModelDims, dtype bytes) of a recipe YAML on ``nodes`` x ``gpus_per_node``
    training GPUs; engines: the recipe's engine count (config.engine_count), used for both modes;
    engine_ep: rollout.engine_ep (the built owner-direct routing depends on it)."""
    from gspo_megatron.config import engine_count, load_config
    from gspo_megatron.dtypes import DTYPE_BYTES
    from gspo_megatron.models.arch import model_hf_config
    from gspo_megatron.planner import ModelDims

    cfg = load_config(config_path, [], check_files=False)
    hf, _ = model_hf_config(cfg)
    p, r = cfg.parallel, cfg.rollout
    world = nodes * gpus_per_node
    lay = Layout(
        world=world,
        gpus_per_node=gpus_per_node,
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        etp=p.etp or p.tp,
        engines=engine_count(cfg, world),
        engine_tp=r.engine_tp,
        engine_ep=r.engine_ep,
    )
    return lay, ModelDims.from_hf_config(hf), DTYPE_BYTES[cfg.model.dtype]


def _ranges(keys: list[int]) -> str:
    keys, out, i = sorted(keys), [], 0
    while i < len(keys):
        j = i
        while j + 1 < len(keys) and keys[j + 1] == keys[j] + 1:
            j += 1
        out.append(str(keys[i]) if i == j else f"{keys[i]}-{keys[j]}")
        i = j + 1
    return ",".join(out)


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f}"


def roles(lay: Layout, mode: str) -> dict[int, str]:
    """A label per training rank for the table."""
    out = {}
    for r in range(lay.world):
        s, off = divmod(r, lay.per_stage)
        owner = off % lay.etp == 0 and off // lay.etp < lay.ep
        if off == 0:
            out[r] = f"stage {s} {'source, ' if mode == 'disaggregated' else ''}dense + EP 0 owner"
        elif owner:
            out[r] = f"stage {s} expert owner"
        elif off < lay.tp:
            out[r] = f"stage {s} TP peer of the owner"
        else:
            out[r] = f"stage {s} other"
    return out


def table(name: str, stages: list[StageBytes], lay: Layout) -> str:
    """The printed per-rank-class and per-node table of one recipe, both modes."""
    model = sum(sb.total for sb in stages)
    lines = [
        f"{name}: {lay.world} training GPUs ({lay.world // lay.gpus_per_node} nodes x "
        f"{lay.gpus_per_node}), tp{lay.tp} pp{lay.pp} ep{lay.ep} etp{lay.etp}, {lay.engines} engines "
        f"of TP{lay.engine_tp} (disaggregated: the same engines on their own nodes); "
        f"model {_gb(model)} GB per sync; per stage " + ", ".join(_gb(sb.total) for sb in stages) + " GB",
        f"  {'mode':<14}{'who':<44}{'GB sent (network)':>19}{'GB to own engine':>18}",
    ]
    for mode in ("colocated", "disaggregated"):
        sent, nodes, local = traffic(stages, lay, mode)
        groups: dict[str, list[int]] = defaultdict(list)
        for r, role in roles(lay, mode).items():
            groups[role].append(r)
        for role, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
            vals = [sent.get(r, 0) for r in ranks]
            loc = [local.get(r, 0) for r in ranks]
            v = _gb(min(vals)) if min(vals) == max(vals) else f"{_gb(min(vals))}-{_gb(max(vals))}"
            lv = _gb(max(loc)) if loc and max(loc) else "-"
            lines.append(f"  {mode:<14}{f'ranks {_ranges(ranks)}: {role}':<44}{v:>19}{lv:>18}")
        eng = [v for k, v in sent.items() if isinstance(k, tuple)]
        if eng:
            v = _gb(max(eng)) if min(eng) == max(eng) else f"{_gb(min(eng))}-{_gb(max(eng))}"
            lines.append(f"  {mode:<14}{f'engine GPUs 0-{len(eng) - 1} (ring relay; last: 0)':<44}{v:>19}{'-':>18}")
        for node in sorted((k for k in nodes if not isinstance(k, tuple))):
            lines.append(f"  {mode:<14}{f'training node {node}: leaves the node':<44}{_gb(nodes[node]):>19}{'':>18}")
        eng_nodes = [v for k, v in nodes.items() if isinstance(k, tuple)]
        if eng_nodes:
            lines.append(f"  {mode:<14}{'engine nodes: leaves each node (max)':<44}{_gb(max(eng_nodes)):>19}{'':>18}")
    return "\n".join(lines)


MEASURED_DELTA_FRACTION = 0.0179  # docs/bench.md, bench/sync_delta.py: median changed elements per sync
PUBLISHED_DELTA_FRACTION = 0.0005  # verl: 0.02-0.05% of bf16 weights change per step (upper end)
SKIP_PREFIXES = ("topology_",)  # CPU topology stand-ins (tiny model, 2 "GPUs" per node)


def recipe_paths(root: str) -> list[str]:
    """configs/*.yaml with a planner header (``--nodes N --gpus-per-node G --gpu-memory-gb M``),
    without the CPU topology stand-ins."""
    import glob

    out = []
    for path in sorted(glob.glob(os.path.join(root, "configs", "*.yaml"))):
        if not os.path.basename(path).startswith(SKIP_PREFIXES) and planner_header(path):
            out.append(path)
    return out


def planner_header(path: str) -> tuple[int, int, float] | None:
    """(nodes, gpus per node, GPU memory GB) from a recipe's ``tools/plan.py`` comment line."""
    m = re.search(r"--nodes (\d+) --gpus-per-node (\d+) --gpu-memory-gb (\d+)", open(path).read())
    return (int(m[1]), int(m[2]), float(m[3])) if m else None


def _who(key, lay: Layout, placement: str) -> str:
    gpu, link, direction = key
    if isinstance(gpu, tuple):
        name = f"engine GPU {gpu[1]}"
    else:
        name = f"rank {gpu}" + (" (engine GPU too)" if placement == "colocated" else "")
    return f"{link} {direction}, {name}"


def time_rows(
    path: str,
    cluster: Cluster,
    fractions: list[float],
    placements: tuple[str, ...] = ("colocated", "disaggregated"),
    engine_ep: int | None = None,
) -> tuple[str, list[tuple]]:
    """(header line, rows of (placement, mode, model bytes, bottleneck text, its bytes, seconds,
    seconds on NVLink / IB alone, the most bytes leaving one node)). Owner-direct as built: colocated
    only, with the recipe's rollout.engine_ep unless ``engine_ep`` is given; disaggregated has no such row."""
    from gspo_megatron.config import load_config

    nodes, gpn, mem = planner_header(path)
    lay, dims, dtype_bytes = recipe_layout(path, nodes, gpn)
    if engine_ep is not None:
        lay = replace(lay, engine_ep=engine_ep)
    stages = stage_bytes(dims, lay.pp, dtype_bytes)
    fp8 = bool(load_config(path, [], check_files=False).rollout.sync_fp8)
    wire = fp8_stage_bytes(dims, stages, dtype_bytes) if fp8 else stages
    model = sum(sb.total for sb in stages)
    wire_total = sum(sb.total for sb in wire)
    header = (
        f"{os.path.relpath(path)}: {nodes} nodes x {gpn} GPUs ({mem:.0f} GB), tp{lay.tp} pp{lay.pp} "
        f"ep{lay.ep} etp{lay.etp}, {lay.engines} engines of TP{lay.engine_tp} EP{lay.engine_ep}; model {_gb(model)} GB "
        + (f"(FP8 on sync: {_gb(wire_total)} GB to the engines)" if fp8 else f"({dtype_bytes}-byte dtype)")
    )
    loads: list[tuple[str, str, LinkLoad]] = []
    for placement in placements:
        loads.append((placement, "full (built)", full_sync_load(stages, lay, placement, cluster, wire)))
        if placement == "colocated":
            od_built = owner_direct_built_load(stages, lay, cluster, wire=wire, num_experts=dims.num_experts)
            loads.append((placement, "owner-direct (built)", od_built))
        loads.append((placement, "owner-direct (designed)", owner_direct_load(stages, lay, placement, cluster, wire)))
        for f in fractions:
            r = delta_ratio(f, dtype_bytes)
            built = delta_as_built_load if placement == "colocated" else delta_http_load
            loads.append((placement, f"delta {f:.2%} (built)", built(stages, lay, cluster, r)))
            loads.append((placement, f"delta {f:.2%} owner", delta_owner_load(stages, lay, placement, cluster, r)))
    rows = []
    for placement, mode, load in loads:
        t, key, b = load.bottleneck()
        net = load.bottleneck(("nvlink", "ib"))[0]
        off = max(node_egress(load).values(), default=0.0)
        rows.append((placement, mode, model, _who(key, lay, placement) if key else "-", b, t, net, off))
    return header, rows


def assumptions(cluster: Cluster, fractions: list[float]) -> str:
    return "\n".join(
        [
            f"cluster: NVLink {cluster.nvlink_gbps:g} GB/s per GPU per direction; InfiniBand {cluster.ib_gbps:g} GB/s "
            f"per NIC per direction, one NIC per GPU, {cluster.nics_per_node} per node (rail-optimized, no PXN); "
            f"PCIe {cluster.pcie_gbps:g} GB/s device <-> host (the delta encoder's host copy)",
            "time = the busiest link direction's bytes / its bandwidth (every transfer pipelined, no latency, "
            "no per-tensor or launch cost, none of the sync's own overhead): a floor, modelled, not measured",
            "net s: the same without PCIe (the time if the compare base were on the GPU); off-node GB: the most "
            "InfiniBand bytes leaving one node (training nodes and engine nodes alike)",
            "NCCL broadcasts are pipelined rings split over channels (cross-node hops on min(NICs, group GPUs on "
            "each node) rails); p2p flows use one NIC per end; same-GPU IPC hand-offs are free",
            "delta: uniform changed fraction per tensor, min(index int32 + value, bitmask + value) "
            f"(fractions {', '.join(f'{f:.2%}' for f in fractions)}; {MEASURED_DELTA_FRACTION:.2%} = median measured "
            f"by bench/sync_delta.py, 5 steps from a random init; {PUBLISHED_DELTA_FRACTION:.2%} = verl's upper "
            "figure for trained models); on FP8-on-sync recipes modelled on model-dtype bytes (delta + sync_fp8 "
            "is refused today)",
            "modes: full (built) = today's export + world broadcast (colocated) / stage-source broadcast "
            "(disaggregated); owner-direct (built) = rollout.sync_owner_direct, colocated only: dense weights by the "
            "world broadcast; each expert tensor held whole by one rank per node whose engine ranks load it: its "
            "owner, else an expert-DP replica (etp 1), else one of those ranks by expert index (ranks[expert % "
            "len(ranks)]: a node's inflow spreads over their NICs), which receives it p2p from a copy: the i-th "
            "such holder (ascending) from (owner, *replicas)[i % count] (the sends spread over the copies); "
            "the node's other engine ranks that load it read their 1 / (engine_tp / engine_ep) slice over NVLink "
            "by CUDA IPC (sglang narrows before copying); owner-direct (designed) = expert owners (or the "
            "expert-DP copy on the engine rank's node) send each engine rank its expert slice p2p, dense weights "
            "by the full sync's broadcast (not built); "
            "delta (built) = colocated delta as weight_sync/cuda_ipc.py does it (full world broadcast, then "
            "device -> host compare on each engine's first rank), disaggregated as weight_sync/delta_http.py (each "
            "stage source compares its stage and writes its changes to the shared file system once, every engine "
            "GPU reads them); delta owner = owners encode their own bytes, "
            "owner-direct routing (designed); disaggregated = the same engines on their own nodes",
        ]
    )


def time_table(path: str, cluster: Cluster, fractions: list[float], engine_ep: int | None = None) -> str:
    header, rows = time_rows(path, cluster, fractions, engine_ep=engine_ep)
    name = os.path.splitext(os.path.basename(path))[0]
    lines = [
        header,
        f"  {'recipe':<24}{'model GB':>9}  {'placement':<15}{'mode':<25}"
        f"{'bottleneck link':<42}{'GB on it':>9}{'seconds':>9}{'net s':>8}{'off-node GB':>13}",
    ]
    for placement, mode, model, who, b, t, net, off in rows:
        lines.append(
            f"  {name:<24}{_gb(model):>9}  {placement:<15}{mode:<25}{who:<42}{_gb(b):>9}{t:>9.3f}{net:>8.3f}"
            f"{_gb(off):>13}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    d = Cluster()
    p = argparse.ArgumentParser(
        description="Bytes per link of each shipped recipe's weight sync, and the "
        "modelled seconds on a stated cluster (module docstring)."
    )
    p.add_argument("recipes", nargs="*", help="recipe YAMLs (default: configs/*.yaml with a planner header)")
    p.add_argument("--nvlink-gbps", type=float, default=d.nvlink_gbps, help="GB/s per GPU per direction (NVLink 4)")
    p.add_argument("--ib-gbps", type=float, default=d.ib_gbps, help="GB/s per NIC per direction (NDR 400 Gb/s)")
    p.add_argument("--nics-per-node", type=int, default=d.nics_per_node)
    p.add_argument("--pcie-gbps", type=float, default=d.pcie_gbps, help="GB/s device <-> host (PCIe 5 x16)")
    p.add_argument(
        "--delta-fractions",
        default=f"{MEASURED_DELTA_FRACTION},{PUBLISHED_DELTA_FRACTION}",
        help="changed-element fractions per sync, comma-separated",
    )
    p.add_argument(
        "--engine-ep",
        type=int,
        default=None,
        help="sglang --ep-size for the owner-direct (built) rows (default: each recipe's rollout.engine_ep)",
    )
    p.add_argument("--bytes", action="store_true", help="also print the per-rank / per-node byte tables")
    a = p.parse_args(argv)
    cluster = Cluster(a.nvlink_gbps, a.ib_gbps, a.nics_per_node, a.pcie_gbps)
    fractions = [float(x) for x in a.delta_fractions.split(",") if x]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(assumptions(cluster, fractions), end="\n\n")
    for path in a.recipes or recipe_paths(root):
        print(time_table(path, cluster, fractions, a.engine_ep), end="\n\n")
        if a.bytes:
            nodes, gpn, _ = planner_header(path)
            lay, dims, dtype_bytes = recipe_layout(path, nodes, gpn)
            print(table(os.path.relpath(path), stage_bytes(dims, lay.pp, dtype_bytes), lay), end="\n\n")


if __name__ == "__main__":
    main()
