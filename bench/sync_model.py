"""The weight-sync byte and link model (no GPU, no files): bytes each training rank, engine GPU and
node sends per sync from a layout and per-stage byte counts (``traffic``), and the bytes per (GPU,
link, direction) of each sync routing (``LinkLoad``: ``full_sync_load``, ``owner_direct_built_load``,
``owner_direct_load``, the delta loads), turned into seconds on a stated cluster. bench/sync_bytes.py
feeds it the shipped recipes and prints the tables; tests/weight_sync/test_sync_bytes.py checks it
against the real export plan (``build_export_plan``), the owner-direct routing
(``weight_sync.owner_direct.OwnerDirectRouting``) and closed forms.
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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple


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
    engine_ep: int = 1  # sglang's --ep-size in each engine (rollout.engine_ep)

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


GB = 1e9  # bandwidths and sizes in decimal GB (NCCL's and the vendors' unit)


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


def node_egress(load: LinkLoad) -> dict:
    """{node: InfiniBand bytes leaving it} of a load (training nodes by index, engine nodes as
    ("engine node", j))."""
    out: dict = defaultdict(float)
    for (gpu, link, direction), b in load.bytes.items():
        if link == "ib" and direction == "out":
            out[load.node(gpu)] += b
    return dict(out)


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


def _overlap(k: int, ep: int, j: int, engine_ep: int) -> Fraction:
    """The fraction of a layer's routed experts in both Megatron EP shard k (experts [k E/ep,
    (k+1) E/ep)) and sglang EP rank j (experts [j E/engine_ep, (j+1) E/engine_ep)); exact whenever
    both divide E, as Megatron and sglang require."""
    lo = max(Fraction(k, ep), Fraction(j, engine_ep))
    hi = min(Fraction(k + 1, ep), Fraction(j + 1, engine_ep))
    return max(hi - lo, Fraction(0))


class BuiltRoute(NamedTuple):
    """One (stage, EP shard, sglang EP rank) of the built owner-direct routing (``built_expert_routes``)."""

    stage: int
    shard: int  # Megatron EP shard k
    ep_rank: int  # sglang EP rank j
    fraction: Fraction  # of the stage's expert bytes: the experts in both shard k and EP rank j
    owner: int  # b_s + k etp (``owner_bytes``)
    copies: tuple[int, ...]  # ranks holding the full tensors without a transfer: the owner, then replicas ascending
    needers: dict[int, tuple[int, ...]]  # node -> its ranks that load these experts, ascending
    near: dict[int, int]  # node -> the first of ``copies`` on it (nodes that have one)
    experts: tuple[int, ...]  # the global expert indices in shard k and EP rank j; () when not known

    def holders_of(self, expert: int) -> dict[int, tuple[int, ...]]:
        """{holder: the needing ranks of its node it serves} for one of the route's experts
        (``OwnerDirectRouting.holders``' rule): on each node the copy there, else
        ``ranks[expert % len(ranks)]`` of the node's needing ranks."""
        return {self.near[n] if n in self.near else rs[expert % len(rs)]: rs for n, rs in self.needers.items()}

    def sender(self, node: int) -> int:
        """The copy that sends its tensors to the holder on ``node``, a node without a copy
        (``weight_sync.buckets._routed``: per expert the receiving holders, ascending, take ``copies`` in
        turn, the i-th ``copies[i % len(copies)]``). Each node without a copy has one receiving holder
        per expert and ranks are node-major, so the i-th receiver is on the i-th such node, whichever
        of its ranks holds the expert: the sender depends on the node alone."""
        lacking = [n for n in sorted(self.needers) if n not in self.near]
        return self.copies[lacking.index(node) % len(self.copies)]

    def holdings(self) -> dict[int, tuple[Fraction, tuple[int, ...]]]:
        """{holder: (the share of the route's bytes it holds, the ranks it serves)}: a copy on the node
        holds all of it; on a node without one each needing rank holds the experts ``holders_of`` gives
        it (count / len(experts)), or an equal share when the experts are not known."""
        if self.experts:
            count: dict[int, int] = defaultdict(int)
            served: dict[int, tuple[int, ...]] = {}
            for x in self.experts:
                for h, rs in self.holders_of(x).items():
                    count[h] += 1
                    served[h] = rs
            return {h: (Fraction(c, len(self.experts)), served[h]) for h, c in count.items()}
        out = {}
        for n, rs in self.needers.items():
            if n in self.near:
                out[self.near[n]] = (Fraction(1), rs)
            else:
                out.update({r: (Fraction(1, len(rs)), rs) for r in rs})
        return out


def _route_experts(k: int, ep: int, j: int, engine_ep: int, num_experts: int | None) -> tuple[int, ...]:
    """The global indices of the experts in both Megatron EP shard k and sglang EP rank j (() when the
    expert count is not known)."""
    if not num_experts:
        return ()
    lo = max(k * num_experts // ep, j * num_experts // engine_ep)
    hi = min((k + 1) * num_experts // ep, (j + 1) * num_experts // engine_ep)
    return tuple(range(lo, hi))


def built_expert_routes(lay: Layout, engine_ep: int | None = None, num_experts: int | None = None) -> list[BuiltRoute]:
    """The owner-direct routing as built (``weight_sync.owner_direct.OwnerDirectRouting.holders``),
    colocated: one ``BuiltRoute`` per (stage, EP shard k, sglang EP rank j) that share experts.
    Engine e's TP rank i sits on training rank e engine_tp + i and loads sglang EP rank
    j = i // (engine_tp / engine_ep)'s experts (engine_ep = 1: all of them). The full tensors sit on
    the owner (expert-DP rank 0, b_s + k etp) and, with etp = 1 only, on every expert-DP replica
    (``expert_holders``; ``build_export_plan``'s ``_Item.copies``). On each node with needing ranks
    the holder of an expert is the lowest of those on the node, else the node's needing rank
    ``ranks[expert % len(ranks)]`` (ascending ranks), which receives the tensors from
    ``BuiltRoute.sender`` (such nodes take the copies in turn): inflow spreads over a node's needing
    ranks, outflow over the copies. ``num_experts``: routed experts per MoE layer (shard k holds
    experts [k E/ep, (k+1) E/ep)); None: not known, each needing rank of a node without a copy holds
    an equal share."""
    eep = lay.engine_ep if engine_ep is None else engine_ep
    if eep < 1 or lay.engine_tp % eep:
        raise ValueError(f"rollout.engine_ep={eep} must divide rollout.engine_tp={lay.engine_tp}")
    if num_experts and (num_experts % eep or num_experts % lay.ep):
        raise ValueError(f"rollout.engine_ep={eep} and parallel.ep={lay.ep} must divide the {num_experts} experts")
    if lay.engines * lay.engine_tp > lay.world:
        raise ValueError(f"{lay.engines} colocated engines of TP{lay.engine_tp} need more than {lay.world} GPUs")
    moe_tp = lay.engine_tp // eep
    needers: dict[int, list[int]] = {j: [] for j in range(eep)}
    for e in range(lay.engines):
        for i in range(lay.engine_tp):
            needers[i // moe_tp].append(e * lay.engine_tp + i)
    routes = []
    for s in range(lay.pp):
        for k in range(lay.ep):
            copies = tuple(expert_holders(lay, s, k)) if lay.etp == 1 else (s * lay.per_stage + k * lay.etp,)
            for j, ranks in needers.items():
                frac = _overlap(k, lay.ep, j, eep)
                if not frac:
                    continue
                by_node: dict[int, tuple[int, ...]] = {}
                for r in sorted(ranks):
                    by_node[lay.node(r)] = by_node.get(lay.node(r), ()) + (r,)
                near = {lay.node(c): c for c in reversed(copies) if lay.node(c) in by_node}  # the first wins
                experts = _route_experts(k, lay.ep, j, eep, num_experts)
                routes.append(BuiltRoute(s, k, j, frac, copies[0], copies, by_node, near, experts))
    return routes


def owner_direct_built_load(
    stages: list[StageBytes],
    lay: Layout,
    cluster: Cluster,
    engine_ep: int | None = None,
    wire: list[StageBytes] | None = None,
    full_reads: bool = False,
    num_experts: int | None = None,
) -> LinkLoad:
    """Owner-direct as built (``rollout.sync_owner_direct``, weight_sync/owner_direct.py; colocated
    only): the (E)TP gathers as today; the dense bytes T_s + R_s by the full sync's world ring broadcast
    from b_s; each routed expert tensor by ``built_expert_routes``: the holder of every node that
    needs it and has neither the owner nor an expert-DP replica gets the FULL tensor p2p from a copy
    (``BuiltRoute.sender``: the i-th such holder, ascending, from ``copies[i % len(copies)]``; both
    NICs: the only inter-node expert bytes, one copy per such node; the holders spread over the
    node's needing ranks by expert index, the sends over the owner and its replicas in turn), and
    every needing engine rank reads it from its node's holder by CUDA IPC (NVLink in the node, free on
    the holder's own GPU). sglang's MoE loader narrows a loaded expert to its slice before copying
    (``FusedMoE._load_w13`` / ``_load_w2``): a reader pulls 1 / (engine_tp / engine_ep) of the tensor
    (``full_reads``: the whole tensor, an upper bound). ``owner_direct_load`` (designed) sends each
    engine rank its 1 / engine_tp share of a shard directly (from a replica on its node, else the
    owner: a node lacking a replica takes gpus_per_node / engine_tp of the tensor, through all its
    NICs); here such a node takes the whole tensor (each expert through one needing rank's NIC) and
    its engine ranks read their slices from the holders over NVLink; replicas only with etp = 1.
    ``engine_ep``: sglang's --ep-size (default ``lay.engine_ep``); ``num_experts``: routed experts per
    MoE layer (``built_expert_routes``; None: equal shares); ``wire``: the stage bytes the engines read
    (FP8-on-sync quantizes at each holder: the broadcast and the p2p carry the model dtype). Every
    routed expert counts as routed: gpt-oss's stacked experts (no shipped recipe) go as in the full sync."""
    eep = lay.engine_ep if engine_ep is None else engine_ep
    wire = wire or stages
    load = LinkLoad(cluster, lay.gpus_per_node)
    _tp_gathers(load, stages, lay)
    world = list(range(lay.world))
    for s, sb in enumerate(stages):
        load.ring_broadcast(world, s * lay.per_stage, sb.tp_sharded + sb.replicated)
    read = 1 if full_reads else Fraction(eep, lay.engine_tp)
    for route in built_expert_routes(lay, eep, num_experts):
        for holder, (share, ranks) in route.holdings().items():
            part = route.fraction * share
            if holder not in route.copies:
                load.p2p(route.sender(lay.node(holder)), holder, float(stages[route.stage].expert * part))
            for r in ranks:
                load.p2p(holder, r, float(wire[route.stage].expert * part * read))
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
