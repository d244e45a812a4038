"""Where the rollout engines live, and which training rank launches which part of which engine.

The production topology (SPEC section 7):

- ``rollout.num_engines`` engines of ``rollout.engine_tp`` GPUs each.
- Colocated: engine e lives on the GPUs of training ranks ``[e*tp, (e+1)*tp)``. Each node that holds
  some of those ranks starts its part of the engine (SGLang's ``--nnodes``, ``--node-rank``,
  ``--dist-init-addr``); the lowest of the engine's ranks on that node does the launching. Node
  rank 0 of the engine serves HTTP. Each of the engine's training ranks later hands its own engine
  TP rank the weight payload (``weight_sync.colocated``).
- Disaggregated: engines have their own GPUs: given by URL (``rollout.engine_urls``, started by the
  launch scripts), or started by global rank 0 on its own node after the training GPUs
  (``base_gpu_id = LOCAL_WORLD_SIZE + e*tp``).

Nodes are identified by torchrun's ``GROUP_RANK`` (the ``--node-rank`` of the launch), so several
simulated nodes on one machine are told apart. A node's address for engine traffic is
``GSPO_NODE_ADDR`` if set, ``127.0.0.1`` when the job's ``MASTER_ADDR`` is a loopback address
(all nodes on this machine), else the address the host name resolves to.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field

import torch.distributed as dist

from gspo_megatron.runtime import distributed as rdist


def node_address() -> str:
    """The address other nodes reach this node's engines / sync groups at (see module docstring)."""
    if os.environ.get("GSPO_NODE_ADDR"):
        return os.environ["GSPO_NODE_ADDR"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        if master == "localhost" or ipaddress.ip_address(master).is_loopback:
            return "127.0.0.1"
    except ValueError:  # a host name
        pass
    return socket.gethostbyname(socket.gethostname())


@dataclass(frozen=True)
class RankInfo:
    """One training rank's place: its node (torchrun GROUP_RANK), local rank, and node address."""

    rank: int
    node: int
    local_rank: int
    address: str


def gather_rank_infos() -> list[RankInfo]:
    """Every rank's RankInfo, indexed by global rank (collective: one all_gather_object)."""
    me = RankInfo(
        rank=rdist.rank(),
        node=int(os.environ.get("GROUP_RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        address=node_address(),
    )
    if rdist.world_size() == 1:
        return [me]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, me)
    return sorted(out, key=lambda r: r.rank)


@dataclass(frozen=True)
class EnginePart:
    """The processes of one engine on one node: started by ``launcher`` (a training rank, or -1 for an
    engine that someone else started), SGLang ``node_rank`` of ``nnodes``, GPUs from ``base_gpu_id``."""

    engine: int
    launcher: int
    node_rank: int
    nnodes: int
    base_gpu_id: int
    address: str


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its TP size, the training ranks sharing its GPUs (colocated; empty otherwise) and
    the parts each node starts. ``parts[0]`` serves HTTP."""

    index: int
    tp: int
    train_ranks: tuple[int, ...]
    parts: tuple[EnginePart, ...] = field(default_factory=tuple)

    @property
    def http_address(self) -> str:
        return self.parts[0].address

    @property
    def src_rank(self) -> int:
        """The training rank that talks to this engine during a colocated sync (its first rank)."""
        return self.train_ranks[0] if self.train_ranks else 0


def plan_engines(infos: list[RankInfo], num_engines: int, tp: int, colocated: bool) -> list[EngineSpec]:
    """The engines and their parts (pure function of the ranks' places; the same on every rank).

    Colocated needs ``num_engines * tp == world size`` (checked by the config); disaggregated engines
    launched here all start on global rank 0's node, after its training GPUs."""
    world = len(infos)
    specs = []
    if colocated:
        if num_engines * tp != world:
            raise ValueError(
                f"colocated engines: rollout.num_engines * rollout.engine_tp = {num_engines} * {tp} "
                f"must equal the {world} training ranks"
            )
        for e in range(num_engines):
            ranks = list(range(e * tp, (e + 1) * tp))
            nodes: list[int] = []
            for r in ranks:
                if infos[r].node not in nodes:
                    nodes.append(infos[r].node)
            parts = []
            for k, node in enumerate(nodes):
                first = min(r for r in ranks if infos[r].node == node)
                parts.append(EnginePart(e, first, k, len(nodes), infos[first].local_rank, infos[first].address))
            sizes = {sum(1 for r in ranks if infos[r].node == n) for n in nodes}
            if len(sizes) != 1:
                raise ValueError(
                    f"engine {e} spans nodes unevenly ({sorted(sizes)} GPUs per node): SGLang splits "
                    "an engine's TP ranks evenly over its nodes; choose rollout.engine_tp as a multiple "
                    "or a divisor of the GPUs per node"
                )
            specs.append(EngineSpec(e, tp, tuple(ranks), tuple(parts)))
        return specs
    local_world = sum(1 for i in infos if i.node == infos[0].node)
    for e in range(num_engines):
        part = EnginePart(e, 0, 0, 1, local_world + e * tp, infos[0].address)
        specs.append(EngineSpec(e, tp, (), (part,)))
    return specs
