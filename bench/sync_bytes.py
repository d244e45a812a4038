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
"""

from __future__ import annotations

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
    from gspo_megatron.planner import DTYPE_BYTES, ModelDims, model_hf_config

    cfg = load_config(config_path, [], check_files=False)
    hf, _ = model_hf_config(cfg)
    p, r = cfg.parallel, cfg.rollout
    world = nodes * gpus_per_node
    lay = Layout(world=world, gpus_per_node=gpus_per_node, tp=p.tp, pp=p.pp, ep=p.ep,
                 etp=p.etp or p.tp, engines=engine_count(cfg, world), engine_tp=r.engine_tp)
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
    lines = [f"{name}: {lay.world} training GPUs ({lay.world // lay.gpus_per_node} nodes x "
             f"{lay.gpus_per_node}), tp{lay.tp} pp{lay.pp} ep{lay.ep} etp{lay.etp}, {lay.engines} engines "
             f"of TP{lay.engine_tp} (disaggregated: the same engines on their own nodes); "
             f"model {_gb(model)} GB per sync; per stage "
             + ", ".join(_gb(sb.total) for sb in stages) + " GB",
             f"  {'mode':<14}{'who':<44}{'GB sent (network)':>19}{'GB to own engine':>18}"]
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
