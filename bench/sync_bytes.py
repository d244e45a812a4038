"""Bytes each training rank, engine GPU and node sends per weight sync, from a recipe's layout and
the model's parameter counts (no GPU, no files). Used by bench/weight_sync.py (``--part bytes``);
tests/weight_sync/test_sync_bytes.py checks the owner / per-source split against the real export
plan (``build_export_plan``) on a gloo world, so these numbers follow the code.

The routing is weight_sync/topology.py's; the stream is models/weights.py's ``export_hf_weights``.
Notation (per pipeline stage s, all in bytes of the model dtype, HF tensors):
  W training ranks, Ws = W / pp per stage, stage s = ranks [s*Ws, (s+1)*Ws) (pp is Megatron's
  outermost rank dimension); layers split evenly over stages; embedding on stage 0, final norm and
  lm_head on the last stage.
  T_s = TP-sharded bytes of the stage (attention q/k/v/o, dense MLPs, embedding, lm_head),
  R_s = replicated bytes (norms, routers), X_s = expert bytes.
Owners (``build_export_plan``: the lowest rank with TP/ETP rank 0 and (expert-)DP rank 0 that holds
the tensor): T_s and R_s belong to the stage's first rank b_s = s*Ws; the experts of EP shard k
(X_s / ep) to rank b_s + k*etp (Megatron's expert grid is etp fastest, then ep, then expert-DP).
Transfers, with NCCL's ring algorithms (ring in rank order):
  (E)TP gather: the DP-first (E)TP group all-gathers; each member sends (n-1)/n of the gathered
    bytes (n = tp for T_s, etp for X_s / ep; replicated tensors are not gathered).
  colocated: every tensor is broadcast from its owner to all W training ranks; a ring broadcast
    from root r is the chain r, r+1, ..., r-1 (mod W): every rank but r-1 forwards the tensor once.
    Then every rank hands its engine TP rank the whole model (payloads by CUDA IPC handle on the
    same GPU: no network bytes; the gloo gather of the handle strings is a few kB, not counted).
  disaggregated: EP owner k != 0 sends its X_s / ep to the stage source b_s (p2p); the source
    broadcasts B_s = T_s + R_s + X_s over its group [source, engine GPU 1..N] (ring: the source
    and every engine GPU but the last forward B_s once). Engines on their own nodes.
A node's off-node bytes are the ring / p2p edges that leave it.

Sync-time model (issue 23; ``python bench/sync_bytes.py [recipe ...] [--nvlink-gbps 450] [--ib-gbps 50]
[--nics-per-node 8] [--pcie-gbps 55] [--delta-fractions 0.0179,0.0005] [--bytes]``): each shipped recipe's
bytes per link turned into seconds on a stated H100 / H200 cluster, for full (built), owner-direct
(designed), delta as built (colocated: weight_sync/cuda_ipc.py; disaggregated: weight_sync/delta_http.py)
and delta from the owners (designed), colocated and disaggregated; t = max over (GPU, link, direction) of bytes / bandwidth (``LinkLoad``). Modelled, not
measured; assumptions in ``assumptions()`` (printed) and docs/bench.md.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    """The recipe's training layout and engines."""

    world: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    engines: int = 1
    engine_tp: int = 1

    @property
    def per_stage(self) -> int:
        return self.world // self.pp

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node


@dataclass(frozen=True)
class StageBytes:
    """T (TP-sharded), R (replicated), X (expert) bytes of one pipeline stage."""

    tp_sharded: int
    replicated: int
    expert: int

    @property
    def total(self) -> int:
        return self.tp_sharded + self.replicated + self.expert


def stage_bytes(dims, pp: int, dtype_bytes: int) -> list[StageBytes]:
    """Per-stage T_s, R_s, X_s from ``planner.layer_params`` (``dims``: planner.ModelDims)."""
    from gspo_megatron.planner import layer_params

    if dims.num_layers % pp:
        raise ValueError(f"{dims.num_layers} layers do not split evenly over pp={pp}")
    per = dims.num_layers // pp
    out = []
    for s in range(pp):
        t = r = x = 0
        for layer in range(s * per, (s + 1) * per):
            lp = layer_params(dims, layer)
            t, r, x = t + lp.tp_sharded, r + lp.replicated, x + lp.expert
        if s == 0:
            t += dims.vocab_size * dims.hidden  # embedding (vocab-parallel)
        if s == pp - 1:
            r += dims.hidden  # final norm
            if not dims.tie_embeddings:
                t += dims.vocab_size * dims.hidden  # lm_head (tied: the embedding, exported once)
        out.append(StageBytes(t * dtype_bytes, r * dtype_bytes, x * dtype_bytes))
    return out


def owner_bytes(stages: list[StageBytes], lay: Layout) -> dict[int, int]:
    """{global rank: HF bytes it owns (assembles)}: what ``build_export_plan`` assigns."""
    own: dict[int, int] = defaultdict(int)
    for s, sb in enumerate(stages):
        base = s * lay.per_stage
        own[base] += sb.tp_sharded + sb.replicated
        for k in range(lay.ep):
            own[base + k * lay.etp] += sb.expert // lay.ep
    return dict(own)


def source_bytes(stages: list[StageBytes], lay: Layout) -> dict[int, int]:
    """Disaggregated: {stage source rank: bytes it broadcasts to the engines} = B_s."""
    return {s * lay.per_stage: sb.total for s, sb in enumerate(stages)}


class _Traffic:
    def __init__(self, lay: Layout):
        self.lay = lay
        self.rank: dict = defaultdict(int)  # key: training rank (int) or ("engine", i)
        self.node: dict = defaultdict(int)  # key: training node (int) or ("engine node", j)

    def _node(self, who):
        if isinstance(who, tuple):
            return ("engine node", who[1] // self.lay.gpus_per_node)
        return self.lay.node(who)

    def edge(self, a, b, nbytes: int) -> None:
        self.rank[a] += nbytes
        if self._node(a) != self._node(b):
            self.node[self._node(a)] += nbytes

    def ring_broadcast(self, members: list, root_index: int, nbytes: int) -> None:
        n = len(members)
        chain = [members[(root_index + i) % n] for i in range(n)]
        for a, b in zip(chain, chain[1:]):
            self.edge(a, b, nbytes)

    def ring_all_gather(self, members: list, nbytes_total: int) -> None:
        n = len(members)
        for i, a in enumerate(members):  # n-1 steps, each member forwards one shard per step
            self.edge(a, members[(i + 1) % n], nbytes_total * (n - 1) // n)


def traffic(stages: list[StageBytes], lay: Layout, mode: str) -> tuple[dict, dict, dict]:
    """({sender: network bytes sent}, {node: bytes leaving it}, {training rank: bytes handed to its
    own engine on the same GPU}) for one sync in ``mode`` (colocated | disaggregated)."""
    t = _Traffic(lay)
    local: dict[int, int] = {}
    for s, sb in enumerate(stages):
        base = s * lay.per_stage
        if lay.tp > 1 and sb.tp_sharded:
            t.ring_all_gather(list(range(base, base + lay.tp)), sb.tp_sharded)
        if lay.etp > 1 and sb.expert:
            for k in range(lay.ep):
                o = base + k * lay.etp
                t.ring_all_gather(list(range(o, o + lay.etp)), sb.expert // lay.ep)
    if mode == "colocated":
        world = list(range(lay.world))
        for owner, nbytes in owner_bytes(stages, lay).items():
            t.ring_broadcast(world, owner, nbytes)
        model = sum(sb.total for sb in stages)
        local = {r: model for r in world}
    elif mode == "disaggregated":
        engine_gpus = [("engine", i) for i in range(lay.engines * lay.engine_tp)]
        for s, sb in enumerate(stages):
            base = s * lay.per_stage
            for k in range(1, lay.ep):
                t.edge(base + k * lay.etp, base, sb.expert // lay.ep)
            t.ring_broadcast([base] + engine_gpus, 0, sb.total)
    else:
        raise ValueError(f"mode must be colocated or disaggregated, got {mode!r}")
    return dict(t.rank), dict(t.node), local


def recipe_layout(config_path: str, nodes: int, gpus_per_node: int = 8) -> tuple[Layout, object, int]:
    """(Layout, planner.ModelDims, dtype bytes) of a recipe YAML on ``nodes`` x ``gpus_per_node``
    training GPUs; engines: the recipe's engine count (config.engine_count), used for both modes."""
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


# ---------------------------------------------------------------------------------------------------
# Sync-time model (issue 23): each recipe's bytes per link -> seconds on a stated cluster.
# ---------------------------------------------------------------------------------------------------

GB = 1e9  # bandwidths and sizes in decimal GB (NCCL's and the vendors' unit)
MEASURED_DELTA_FRACTION = 0.0179  # docs/bench.md, bench/sync_delta.py: median changed elements per sync
PUBLISHED_DELTA_FRACTION = 0.0005  # verl: 0.02-0.05% of bf16 weights change per step (upper end)
SKIP_PREFIXES = ("topology_",)  # CPU topology stand-ins (tiny model, 2 "GPUs" per node)


@dataclass(frozen=True)
class Cluster:
    """Per-GPU bandwidths, GB/s per direction (full duplex), effective (what a large transfer reaches).

    Defaults: an H100 / H200 SXM node (NVLink 4: ~450 GB/s per GPU per direction; one InfiniBand
    NDR NIC per GPU, 400 Gb/s = 50 GB/s, 8 per node, rail-optimized; host <-> device PCIe 5 x16
    ~55 GB/s). Both GPU kinds have the same links, so the model does not tell them apart."""

    nvlink_gbps: float = 450.0
    ib_gbps: float = 50.0
    nics_per_node: int = 8
    pcie_gbps: float = 55.0

    def gbps(self, link: str) -> float:
        return {"nvlink": self.nvlink_gbps, "ib": self.ib_gbps, "pcie": self.pcie_gbps}[link]


def transfer_seconds(nbytes: float, gbps: float) -> float:
    """t = bytes / (bandwidth in GB/s x 1e9): a pipelined transfer's floor (no latency term)."""
    return nbytes / (gbps * GB)


def delta_wire_bytes(elements: float, fraction: float, elem_bytes: float, index_bytes: int = 4) -> float:
    """Bytes of a delta of ``fraction`` changed elements (weight_sync/delta.py's encodings), k = f n:
    min(index: k (i + e), bitmask: n / 8 + k e, full: n e); i = 4 (int32 indices below 2**31 elements).
    bf16: index below f = 1/32 (3.1%), bitmask above, full above f = 7/8 ... never for a bitmask with
    e >= 1 (n/8 + n e > n e only at f = 1)."""
    k = fraction * elements
    return min(k * (index_bytes + elem_bytes), elements / 8 + k * elem_bytes, elements * elem_bytes)


def delta_ratio(fraction: float, elem_bytes: float, index_bytes: int = 4) -> float:
    """Delta bytes / full bytes at a uniform changed ``fraction``: delta_wire_bytes(1, f, e, i) / e
    (bf16, index: 3 f; 1.79% -> 5.4%, 0.05% -> 0.15%)."""
    return delta_wire_bytes(1.0, fraction, elem_bytes, index_bytes) / elem_bytes


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


class LinkLoad:
    """Bytes per (GPU, link, direction) of one sync, and its time: the sync is taken as one pipelined
    transfer set, so it lasts as long as its busiest link direction,

        t = max over (gpu, link in {nvlink, ib, pcie}, direction) of bytes / bandwidth(link),

    a floor: no latency, no per-bucket or per-tensor launch cost, no serialization between
    transfers, none of the sync's own overhead (2.7-3.6x a plain transfer measured on CPU,
    bench/weight_sync.py).

    Links: same GPU (colocated CUDA IPC handle to its own engine rank): no link, not counted (the
    engine's copy of its shard runs at HBM speed, ~3 TB/s); same node: NVLink (a GPU's NVLink
    egress / ingress); other node: InfiniBand through the sender's and the receiver's own NIC
    (rail-optimized, one NIC per GPU, no PXN: a p2p flow uses one NIC at each end).

    NCCL broadcasts are rings (NCCL has no tree broadcast; trees serve all-reduce only), pipelined
    in chunks: each member forwards every byte once, so the time is bytes / the slowest hop,
    whatever the group size, where a binary tree would have each parent send every byte twice. NCCL
    splits a collective over channels, each a ring through a different NIC of a rail-optimized
    node, so a ring hop between nodes a and b carries bytes / r on each of r = min(NICs per node,
    group members on a, members on b) NICs: 8 between two full nodes, 1 out of a node where only
    the sending rank is in the group (a disaggregated stage source)."""

    def __init__(self, cluster: Cluster, gpus_per_node: int):
        self.cluster, self.gpn = cluster, gpus_per_node
        self.bytes: dict[tuple, float] = defaultdict(float)  # (gpu, link, "out" | "in") -> bytes
        self.senders: dict[int, float] = {}  # owner-direct: sending rank -> bytes it holds and sends

    def node(self, gpu):
        if isinstance(gpu, tuple):
            return ("engine node", gpu[1] // self.gpn)
        return gpu // self.gpn

    def p2p(self, a, b, nbytes: float) -> None:
        """One flow a -> b: nothing on the same GPU, NVLink in the node, both ends' NICs across nodes."""
        if a == b or not nbytes:
            return
        link = "nvlink" if self.node(a) == self.node(b) else "ib"
        self.bytes[(a, link, "out")] += nbytes
        self.bytes[(b, link, "in")] += nbytes

    def ring_broadcast(self, members: list, root_index: int, nbytes: float) -> None:
        """NCCL ring broadcast from members[root_index] (chain in member order, class docstring)."""
        n = len(members)
        chain = [members[(root_index + i) % n] for i in range(n)]
        on_node: dict = defaultdict(list)
        for m in members:
            on_node[self.node(m)].append(m)
        for a, b in zip(chain, chain[1:]):
            na, nb = self.node(a), self.node(b)
            if na == nb:
                self.p2p(a, b, nbytes)
                continue
            rails = min(self.cluster.nics_per_node, len(on_node[na]), len(on_node[nb]))
            for x, y in zip(on_node[na][:rails], on_node[nb][:rails]):
                self.bytes[(x, "ib", "out")] += nbytes / rails
                self.bytes[(y, "ib", "in")] += nbytes / rails

    def ring_all_gather(self, members: list, total: float) -> None:
        """Ring all-gather of ``total`` bytes: each member sends (n - 1) / n of them to the next."""
        n = len(members)
        for i, a in enumerate(members):
            self.p2p(a, members[(i + 1) % n], total * (n - 1) / n)

    def pcie(self, gpu, nbytes: float) -> None:
        """Device -> host copy (the delta encoder's comparison against its host copy)."""
        self.bytes[(gpu, "pcie", "out")] += nbytes

    def bottleneck(self, links: tuple[str, ...] = ("nvlink", "ib", "pcie")) -> tuple[float, tuple | None, float]:
        """(seconds, (gpu, link, direction) of the busiest link direction among ``links``, its bytes)."""
        best: tuple[float, tuple | None, float] = (0.0, None, 0.0)
        for key, b in self.bytes.items():
            if key[1] not in links:
                continue
            t = transfer_seconds(b, self.cluster.gbps(key[1]))
            if t > best[0]:
                best = (t, key, b)
        return best


def engine_gpus(lay: Layout, placement: str) -> list:
    """Engine e's TP rank j: colocated on training GPU e * engine_tp + j (cuda_ipc.py's layout);
    disaggregated ("engine", e * engine_tp + j) on the engines' own nodes."""
    n = lay.engines * lay.engine_tp
    return list(range(n)) if placement == "colocated" else [("engine", i) for i in range(n)]


def _tp_gathers(load: LinkLoad, stages: list[StageBytes], lay: Layout) -> None:
    for s, sb in enumerate(stages):
        base = s * lay.per_stage
        if lay.tp > 1 and sb.tp_sharded:
            load.ring_all_gather(list(range(base, base + lay.tp)), sb.tp_sharded)
        if lay.etp > 1 and sb.expert:
            for k in range(lay.ep):
                o = base + k * lay.etp
                load.ring_all_gather(list(range(o, o + lay.etp)), sb.expert / lay.ep)


def full_sync_load(
    stages: list[StageBytes], lay: Layout, placement: str, cluster: Cluster, wire: list[StageBytes] | None = None
) -> LinkLoad:
    """Today's full sync (``traffic``'s routing): (E)TP all-gathers (model dtype), then
    colocated: a world ring broadcast of every owner's bytes, each rank handing its own engine rank
    the model by IPC (same GPU, free); cross-node hops on 8 rails, so t = max(model / NVLink,
    model / (8 x IB)) on two or more nodes;
    disaggregated: EP owners -> stage source (p2p), the source rings its stage B_s over
    [source, engine GPUs]; one rail leaves the source's node (only the source is in the group) and
    every stage enters the first engine GPU: t ~ model / IB.
    ``wire``: the stage bytes on the engine links (FP8-on-sync: quantized after the export, so the
    colocated world broadcast carries the model dtype, the disaggregated broadcast the FP8 bytes)."""
    wire = wire or stages
    load = LinkLoad(cluster, lay.gpus_per_node)
    _tp_gathers(load, stages, lay)
    if placement == "colocated":
        world = list(range(lay.world))
        for owner, nbytes in owner_bytes(stages, lay).items():
            load.ring_broadcast(world, owner, nbytes)
    else:
        engines = engine_gpus(lay, placement)
        for s, (sb, wb) in enumerate(zip(stages, wire)):
            base = s * lay.per_stage
            for k in range(1, lay.ep):
                load.p2p(base + k * lay.etp, base, sb.expert / lay.ep)
            load.ring_broadcast([base] + engines, 0, wb.total)
    return load


def expert_holders(lay: Layout, stage: int, k: int) -> list[int]:
    """Ranks holding EP shard k of ``stage`` after its ETP gather (the first of each ETP group): one per
    expert-DP replica, base + k etp + j ep etp (Megatron's expert grid: etp fastest, then ep, then
    expert-DP); the first is the owner ``build_export_plan`` picks."""
    base, edp = stage * lay.per_stage, max(1, lay.per_stage // (lay.ep * lay.etp))
    return [base + k * lay.etp + j * lay.ep * lay.etp for j in range(edp)]


def owner_direct_load(
    stages: list[StageBytes],
    lay: Layout,
    placement: str,
    cluster: Cluster,
    wire: list[StageBytes] | None = None,
    scale: float = 1.0,
) -> LinkLoad:
    """Owner-direct (issue 23, designed, not built): the experts go p2p, the dense part as today.
    After the (E)TP gathers, engine TP rank j of each of the E engines gets X_s / (ep x engine_tp)
    of each EP shard k (an engine rank holds 1/engine_tp of the experts, with sglang's TP or EP MoE
    alike) from the copy of shard k on the engine rank's node if an expert-DP replica is there, else
    from its owner: expert owner egress <= E X_s / ep, engine GPU ingress ~ X / engine_tp. The dense
    bytes T_s + R_s (a few % of an MoE) go by the full sync's ring broadcast (colocated: over the
    world, multi-rail; disaggregated: from the stage source over [source, engine GPUs], one rail out
    of its node), because p2p from one dense owner to every engine rank would put E (T_s + engine_tp
    R_s) on that owner's NIC. ``scale``: the fraction of the bytes sent (a delta's ratio; the
    gathers stay full). Colocated p2p: a flow to the sender's own GPU is free, within its node NVLink,
    else both NICs. The load's ``senders`` maps each sending rank to the bytes it holds and sends."""
    wire = wire or stages
    load = LinkLoad(cluster, lay.gpus_per_node)
    _tp_gathers(load, stages, lay)
    engines = engine_gpus(lay, placement)
    et = lay.engine_tp
    held: dict[int, set] = defaultdict(set)
    for s, wb in enumerate(wire):
        base = s * lay.per_stage
        holders = [expert_holders(lay, s, k) for k in range(lay.ep)]
        dense = (wb.tp_sharded + wb.replicated) * scale
        held[base].add((s, "dense"))
        if placement == "colocated":
            load.ring_broadcast(list(range(lay.world)), base, dense)
        else:
            load.ring_broadcast([base] + engines, 0, dense)
        for g in engines:
            for k in range(lay.ep):
                near = [h for h in holders[k] if load.node(h) == load.node(g)]
                src = near[0] if near else holders[k][0]
                load.p2p(src, g, wb.expert / (lay.ep * et) * scale)
                held[src].add((s, k))
    sizes = {(s, "dense"): sb.tp_sharded + sb.replicated for s, sb in enumerate(stages)}
    sizes.update({(s, k): sb.expert / lay.ep for s, sb in enumerate(stages) for k in range(lay.ep)})
    load.senders = {r: sum(sizes[x] for x in xs) for r, xs in held.items()}
    return load


def delta_as_built_load(stages: list[StageBytes], lay: Layout, cluster: Cluster, ratio: float) -> LinkLoad:
    """Delta sync as built (weight_sync/cuda_ipc.py, colocated only): the full sync's export and
    world broadcast unchanged; each engine's first rank copies every bucket device -> host and
    compares it with its host copy (model bytes over its PCIe; the CPU compare itself is not
    counted), then ring-broadcasts the encoded changes (ratio x model) over its engine's ranks."""
    load = full_sync_load(stages, lay, "colocated", cluster)
    model = sum(sb.total for sb in stages)
    for e in range(lay.engines):
        members = list(range(e * lay.engine_tp, (e + 1) * lay.engine_tp))
        load.pcie(members[0], model)
        load.ring_broadcast(members, 0, model * ratio)
    return load


def delta_http_load(stages: list[StageBytes], lay: Layout, cluster: Cluster, ratio: float) -> LinkLoad:
    """Disaggregated delta sync as built (weight_sync/delta_http.py): the export's (E)TP gathers and
    the EP owners' p2p to each stage source as in the full sync; each source copies its stage device ->
    host (its PCIe) to compare it with its host copy and writes ratio x its stage bytes to the shared
    file system once (its NIC out), and every engine GPU reads every stage's changes (its NIC in); the
    HTTP calls carry only the file's name. The file system's own bandwidth is not modelled (taken as
    no slower than the NICs); full syncs (start, restart) write and read the whole model the same way."""
    load = LinkLoad(cluster, lay.gpus_per_node)
    _tp_gathers(load, stages, lay)
    for s, sb in enumerate(stages):
        base = s * lay.per_stage
        for k in range(1, lay.ep):
            load.p2p(base + k * lay.etp, base, sb.expert / lay.ep)
        load.pcie(base, sb.total)
        load.bytes[(base, "ib", "out")] += sb.total * ratio
        for g in engine_gpus(lay, "disaggregated"):
            load.bytes[(g, "ib", "in")] += sb.total * ratio
    return load


def delta_owner_load(stages: list[StageBytes], lay: Layout, placement: str, cluster: Cluster, ratio: float) -> LinkLoad:
    """Delta sync from the owners (designed, not built): each sender of the owner-direct routing
    compares what it sends with its host copy (those bytes device -> host over its own PCIe:
    held / PCIe, whatever the fraction), then the owner-direct routing carries ratio x the bytes."""
    load = owner_direct_load(stages, lay, placement, cluster, scale=ratio)
    for sender, nbytes in load.senders.items():
        load.pcie(sender, nbytes)
    return load


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
    path: str, cluster: Cluster, fractions: list[float], placements: tuple[str, ...] = ("colocated", "disaggregated")
) -> tuple[str, list[tuple]]:
    """(header line, rows of (placement, mode, model bytes, bottleneck text, its bytes, seconds,
    seconds on NVLink / IB alone))."""
    from gspo_megatron.config import load_config

    nodes, gpn, mem = planner_header(path)
    lay, dims, dtype_bytes = recipe_layout(path, nodes, gpn)
    stages = stage_bytes(dims, lay.pp, dtype_bytes)
    fp8 = bool(load_config(path, [], check_files=False).rollout.sync_fp8)
    wire = fp8_stage_bytes(dims, stages, dtype_bytes) if fp8 else stages
    model = sum(sb.total for sb in stages)
    wire_total = sum(sb.total for sb in wire)
    header = (
        f"{os.path.relpath(path)}: {nodes} nodes x {gpn} GPUs ({mem:.0f} GB), tp{lay.tp} pp{lay.pp} "
        f"ep{lay.ep} etp{lay.etp}, {lay.engines} engines of TP{lay.engine_tp}; model {_gb(model)} GB "
        + (f"(FP8 on sync: {_gb(wire_total)} GB to the engines)" if fp8 else f"({dtype_bytes}-byte dtype)")
    )
    loads: list[tuple[str, str, LinkLoad]] = []
    for placement in placements:
        loads.append((placement, "full (built)", full_sync_load(stages, lay, placement, cluster, wire)))
        loads.append((placement, "owner-direct", owner_direct_load(stages, lay, placement, cluster, wire)))
        for f in fractions:
            r = delta_ratio(f, dtype_bytes)
            built = delta_as_built_load if placement == "colocated" else delta_http_load
            loads.append((placement, f"delta {f:.2%} (built)", built(stages, lay, cluster, r)))
            loads.append((placement, f"delta {f:.2%} owner", delta_owner_load(stages, lay, placement, cluster, r)))
    rows = []
    for placement, mode, load in loads:
        t, key, b = load.bottleneck()
        net = load.bottleneck(("nvlink", "ib"))[0]
        rows.append((placement, mode, model, _who(key, lay, placement) if key else "-", b, t, net))
    return header, rows


def assumptions(cluster: Cluster, fractions: list[float]) -> str:
    return "\n".join(
        [
            f"cluster: NVLink {cluster.nvlink_gbps:g} GB/s per GPU per direction; InfiniBand {cluster.ib_gbps:g} GB/s "
            f"per NIC per direction, one NIC per GPU, {cluster.nics_per_node} per node (rail-optimized, no PXN); "
            f"PCIe {cluster.pcie_gbps:g} GB/s device <-> host (the delta encoder's host copy)",
            "time = the busiest link direction's bytes / its bandwidth (every transfer pipelined, no latency, "
            "no per-tensor or launch cost, none of the sync's own overhead): a floor, modelled, not measured",
            "net s: the same without PCIe (the time if the compare base were on the GPU)",
            "NCCL broadcasts are pipelined rings split over channels (cross-node hops on min(NICs, group GPUs on "
            "each node) rails); p2p flows use one NIC per end; same-GPU IPC hand-offs are free",
            "delta: uniform changed fraction per tensor, min(index int32 + value, bitmask + value) "
            f"(fractions {', '.join(f'{f:.2%}' for f in fractions)}; {MEASURED_DELTA_FRACTION:.2%} = median measured "
            f"by bench/sync_delta.py, 5 steps from a random init; {PUBLISHED_DELTA_FRACTION:.2%} = verl's upper "
            "figure for trained models); on FP8-on-sync recipes modelled on model-dtype bytes (delta + sync_fp8 "
            "is refused today)",
            "modes: full (built) = today's export + world broadcast (colocated) / stage-source broadcast "
            "(disaggregated); owner-direct = expert owners (or the expert-DP copy on the engine rank's node) send each "
            "engine rank its expert slice p2p, dense weights by the full sync's broadcast (designed, not built); "
            "delta (built) = colocated delta as weight_sync/cuda_ipc.py does it (full world broadcast, then "
            "device -> host compare on each engine's first rank), disaggregated as weight_sync/delta_http.py (each "
            "stage source compares its stage and writes its changes to the shared file system once, every engine "
            "GPU reads them); delta owner = owners encode their own bytes, "
            "owner-direct routing (designed); disaggregated = the same engines on their own nodes",
        ]
    )


def time_table(path: str, cluster: Cluster, fractions: list[float]) -> str:
    header, rows = time_rows(path, cluster, fractions)
    name = os.path.splitext(os.path.basename(path))[0]
    lines = [
        header,
        f"  {'recipe':<24}{'model GB':>9}  {'placement':<14}{'mode':<22}"
        f"{'bottleneck link':<42}{'GB on it':>9}{'seconds':>9}{'net s':>8}",
    ]
    for placement, mode, model, who, b, t, net in rows:
        lines.append(f"  {name:<24}{_gb(model):>9}  {placement:<14}{mode:<22}{who:<42}{_gb(b):>9}{t:>9.3f}{net:>8.3f}")
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
    p.add_argument("--bytes", action="store_true", help="also print the per-rank / per-node byte tables")
    a = p.parse_args(argv)
    cluster = Cluster(a.nvlink_gbps, a.ib_gbps, a.nics_per_node, a.pcie_gbps)
    fractions = [float(x) for x in a.delta_fractions.split(",") if x]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(assumptions(cluster, fractions), end="\n\n")
    for path in a.recipes or recipe_paths(root):
        print(time_table(path, cluster, fractions), end="\n\n")
        if a.bytes:
            nodes, gpn, _ = planner_header(path)
            lay, dims, dtype_bytes = recipe_layout(path, nodes, gpn)
            print(table(os.path.relpath(path), stage_bytes(dims, lay.pp, dtype_bytes), lay), end="\n\n")


if __name__ == "__main__":
    main()
