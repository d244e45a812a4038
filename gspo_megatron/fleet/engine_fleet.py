"""The SGLang engines of a run, as every training rank sees them: who launched which part, the URL of
each engine, restarts, shutdown.

Collective: every rank builds an :class:`EngineFleet` and calls ``ready`` / ``restart`` / ``shutdown``
together. ``engines.placement`` decides where engine parts live; building the fleet starts them: the
ranks that launch a part start its server process (``sglang.launch_server``, or with
``rollout.engine_server=cpu`` the CPU stand-in ``gspo_megatron.cpu_server``, same flags, same HTTP
API) and return at once. ``ready()`` waits until every engine answers. In between the trainer may
work: ``train.build_trainer`` starts disaggregated engines before it builds the model, so that
sglang's start-up (weights, CUDA graphs: minutes at 30B+) overlaps the model build and the checkpoint
load. Global rank 0 drives generation on all engines (``engine``, an :class:`SGLangRolloutEngine`);
each engine's colocated source rank holds a client of its own engine for the weight sync
(``client(e)``).

Restart (after rank 0 found engines dead): the launching ranks of those engines kill what is left of
their parts and start them again on the same ports, then every rank waits for the engines to answer.
Attached engines (``rollout.engine_urls``, started by the launch scripts) cannot be restarted from
here: the trainer waits up to ``rollout.engine_timeout_s`` for them to come back (the launch script
may supervise them) and then re-syncs.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch.distributed as dist

from gspo_megatron.engines.engine_model import prepare_engine_model_dir
from gspo_megatron.engines.placement import EnginePart, EngineSpec, gather_rank_infos, plan_engines
from gspo_megatron.engines.sglang_client import SGLangError, SGLangHttpClient
from gspo_megatron.engines.sglang_engine import SGLangRolloutEngine, kill_server, launch_server, wait_until_healthy
from gspo_megatron.features.sync_modes import sync_mode
from gspo_megatron.fleet.engine_args import attached_engine_errors, config_server_env
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.runtime import stop
from gspo_megatron.runtime.ports import free_port

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 60.0
SERVER_MODULES = {"sglang": "sglang.launch_server", "cpu": "gspo_megatron.cpu_server"}


def _all_gather(obj) -> list:
    if rdist.world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class EngineFleet:
    """See the module docstring. ``model_path``: the HF directory the engines start from (its config
    and tokenizer; weights are then synced). ``hf``: its config.json as a dict, as the caller read it
    (the check of attached engines' flags needs it). ``server_args``: extra SGLang server args for
    every part (e.g. ``random_seed``, ``enable_deterministic_inference``, quantization). ``route_spec``:
    the policy's ``engines.routing.RouteSpec`` with routing replay r3 (every request asks for its
    routed experts)."""

    def __init__(
        self,
        cfg,
        model_path: str,
        hf: dict | None,
        server_args: dict[str, Any] | None = None,
        log_dir: str | None = None,
        route_spec: Any = None,
    ):
        r = cfg.rollout
        self.rank, self.world = rdist.rank(), rdist.world_size()
        self.colocated = sync_mode(r.sync_mode).colocated  # engines share the training GPUs
        self.wait_s = r.engine_launch_timeout_s
        self.request_timeout_s = r.engine_timeout_s
        self.log_dir = log_dir
        self.module = SERVER_MODULES[r.engine_server]
        self.cfg, self.model_path, self.output_dir = cfg, model_path, cfg.output_dir
        self.hf, self.route_spec = hf, route_spec
        self.processes: dict[tuple[int, int], Any] = {}  # (engine, node_rank) -> Popen, on the launcher
        self.attached = bool(r.engine_urls)
        self.base_args = dict(
            model_path=model_path,
            tp_size=r.engine_tp,
            skip_server_warmup=True,
            enable_memory_saver=self.colocated,
            mem_fraction_static=r.engine_mem_fraction,
            **(server_args or {}),
        )
        self.engine: SGLangRolloutEngine | None = None  # rank 0's, once ready()
        self.world_sizes: list[int] = []
        if self.attached:
            self.specs = [EngineSpec(e, r.engine_tp, (), ()) for e in range(len(r.engine_urls))]
            self.urls = list(r.engine_urls)
        else:
            infos = gather_rank_infos()
            from gspo_megatron.config import engine_count

            num = engine_count(cfg, self.world)  # the planner's count
            self.specs = plan_engines(infos, num, r.engine_tp, self.colocated)
            self.ports = self._choose_ports()
            self._start_parts([s.index for s in self.specs])
            self.urls = [f"http://{s.http_address}:{self.ports[s.index][0]}" for s in self.specs]
        self.launched_at = time.monotonic()

    def ready(self) -> EngineFleet:
        """Collective: wait until every engine answers (launched ones: up to
        ``rollout.engine_launch_timeout_s`` from now; attached ones: the same, then their flags are
        checked), learn each engine's world size, and on rank 0 build the generation client
        (``engine``). Raises ``SGLangError`` (launched engines killed) or ``runtime.stop.Stopped``."""
        r = self.cfg.rollout
        attach_errors: list[str] = []
        stopped = ""  # a stop signal while an engine was starting (runtime/stop.py), on any rank
        waited_from = time.monotonic()
        if not self.attached:
            self._await_parts([s.index for s in self.specs])
        elif self.rank == 0:
            try:
                for url in self.urls:
                    wait_until_healthy(SGLangHttpClient(url), None, self.wait_s)
            except stop.Stopped as e:  # the other ranks learn it from the broadcast below
                stopped = str(e)
            else:
                attach_errors = self._attached_errors()
        # engine world sizes as the engines report them (not rollout.engine_tp): the weight-update
        # group's size must match what the engines join with
        sizes = None
        if self.rank == 0 and not stopped:
            sizes = [SGLangHttpClient(u).world_size for u in self.urls]
        # every rank raises the attached engines' missing flags (rank 0 read them) before any sync
        sizes, attach_errors, stopped = rdist.broadcast_object((sizes, attach_errors, stopped))
        if stopped:
            raise stop.Stopped(stopped)
        if attach_errors:
            from gspo_megatron.errors import ConfigError

            raise ConfigError(attach_errors)
        self.world_sizes = sizes
        if self.rank == 0:
            router = r.router_url if self.attached else None
            self.engine = SGLangRolloutEngine(
                [self.client(e) for e in range(len(self.urls))],
                router=SGLangHttpClient(router, timeout_s=self.request_timeout_s) if router else None,
                send_seeds=r.engine_deterministic,
                route_spec=self.route_spec,
            )
            now = time.monotonic()
            print(
                f"[gspo-train] {len(self.urls)} engine(s) ready {now - self.launched_at:.1f}s after "
                f"{'attaching' if self.attached else 'their launch'} ({now - waited_from:.1f}s of it waited for)",
                flush=True,
            )
        return self

    # -- launching -------------------------------------------------------------------------------------
    def _choose_ports(self) -> dict[int, tuple[int, int]]:
        """(http port, dist-init port) per engine, chosen by the launcher of its node-rank-0 part."""
        mine = {}
        for s in self.specs:
            if s.parts[0].launcher == self.rank:
                host = s.parts[0].address
                mine[s.index] = (free_port(host), free_port(host))
        ports: dict[int, tuple[int, int]] = {}
        for part in _all_gather(mine):
            ports.update(part)
        return ports

    def _attached_errors(self) -> list[str]:
        """Rank 0: what the attached engines lack of the flags the config needs (``fleet/engine_args.py``),
        read from each one's ``/server_info``; one line per missing flag."""
        return [
            e
            for url in self.urls
            for e in attached_engine_errors(
                self.cfg, self.hf, url, SGLangHttpClient(url).server_info(), route_spec=self.route_spec
            )
        ]

    def _part_args(self, spec: EngineSpec, part: EnginePart) -> dict[str, Any]:
        http_port, dist_port = self.ports[spec.index]
        args = dict(self.base_args, host=part.address, port=http_port, base_gpu_id=part.base_gpu_id)
        if part.nnodes > 1:
            args.update(nnodes=part.nnodes, node_rank=part.node_rank, dist_init_addr=f"{spec.http_address}:{dist_port}")
        return args

    def _start_parts(self, engines: list[int]) -> None:
        """Start this rank's parts of ``engines``; returns at once (:meth:`_await_parts` waits)."""
        for spec in self.specs:
            if spec.index not in engines:
                continue
            for part in spec.parts:
                if part.launcher != self.rank:
                    continue
                log = None
                if self.log_dir:
                    os.makedirs(self.log_dir, exist_ok=True)
                    log = os.path.join(self.log_dir, f"engine{spec.index}_node{part.node_rank}.log")
                env = dict(os.environ, GSPO_ENGINE=f"{spec.index}.{part.node_rank}")  # names the process
                for k, v in config_server_env(self.base_args).items():  # e.g. DSA's indexer ids as
                    env.setdefault(k, v)  # positions, not KV-pool slots (fleet/engine_args.py)
                # the engine's own model dir (FP8-on-sync engines start quantized) and extra flags
                model_path, extra_cli = prepare_engine_model_dir(
                    self.cfg, self.model_path, os.path.join(self.output_dir, "engine_model", f"rank{self.rank}")
                )
                args = dict(self._part_args(spec, part), model_path=model_path)
                self.processes[(spec.index, part.node_rank)] = launch_server(
                    args, module=self.module, log_path=log, python=sys.executable, env=env, extra_cli=extra_cli
                )
                print(
                    f"[gspo-train] rank {self.rank}: engine {spec.index} part {part.node_rank}/{part.nnodes} "
                    f"({spec.tp} TP ranks, {self.module}) starting; log {log}",
                    flush=True,
                )

    def _await_parts(self, engines: list[int]) -> None:
        """Collective: wait until ``engines`` (started by :meth:`_start_parts`) all answer; on any
        rank's failure or stop signal every rank kills its parts and raises."""
        errors, stopped = [], []
        for spec in self.specs:
            part = spec.parts[0]
            if spec.index in engines and part.launcher == self.rank:
                proc = self.processes[(spec.index, 0)]
                url = f"http://{part.address}:{self.ports[spec.index][0]}"
                try:
                    wait_until_healthy(
                        SGLangHttpClient(url),
                        proc,
                        self.wait_s,
                        os.path.join(self.log_dir, f"engine{spec.index}_node0.log") if self.log_dir else None,
                    )
                except SGLangError as e:
                    errors.append(str(e))
                except stop.Stopped as e:  # a stop signal: every rank learns it from the gather below
                    stopped.append(str(e))
        parts = _all_gather((errors, stopped))
        errors, stopped = [e for part, _ in parts for e in part], [e for _, part in parts for e in part]
        if errors or stopped:
            self._kill_mine(engines)
        if stopped:
            raise stop.Stopped(stopped[0])
        if errors:
            raise SGLangError("; ".join(errors))

    def _kill_mine(self, engines: list[int]) -> None:
        for (e, k), proc in list(self.processes.items()):
            if e in engines:
                kill_server(proc)
                del self.processes[(e, k)]

    # -- what the trainer uses -------------------------------------------------------------------------
    def client(self, e: int) -> SGLangHttpClient:
        """A client of engine ``e`` (any rank may hold one: HTTP is stateless); a sync pauses it in
        ``rollout.inflight_updates``' mode when that is on (``sglang_client.open_weight_update``)."""
        mode = self.cfg.rollout.inflight_updates
        return SGLangHttpClient(
            self.urls[e], timeout_s=self.request_timeout_s, pause_mode="abort" if mode == "off" else mode
        )

    def restart(self, engines: list[int]) -> None:
        """Collective: bring ``engines`` (dead ones, as rank 0 found) back on the same URLs."""
        if self.attached:
            stopped = ""
            if self.engine is not None:  # rank 0
                try:
                    for e in engines:
                        wait_until_healthy(SGLangHttpClient(self.urls[e]), None, self.wait_s)
                        self.engine.engine_restarted(e)
                except stop.Stopped as err:
                    stopped = str(err)
            if rdist.broadcast_object(stopped):  # (the barrier every rank waited at)
                raise stop.Stopped(stopped)
            return
        self._kill_mine(engines)
        rdist.barrier()  # every part of a multi-node engine is down before any is started again
        self._start_parts(engines)
        self._await_parts(engines)
        if self.engine is not None:
            for e in engines:
                self.engine.engine_restarted(e)

    def dead_engines(self) -> list[int]:
        """Rank 0: the engines that do not answer (see :func:`dead_engines`)."""
        if self.engine is None:  # built on rank 0 only
            raise RuntimeError("EngineFleet.dead_engines: rank 0 only (it holds the engines' client)")
        return dead_engines(self.engine)

    def shutdown(self) -> None:
        """Every rank: stop the server processes this rank launched."""
        self._kill_mine([s.index for s in self.specs])


def dead_engines(engine: SGLangRolloutEngine) -> list[int]:
    """The engines of ``engine`` that do not answer: ``/health_generate`` (a one-token generation)
    for an engine that holds its memory; for one that released any (colocated, between a release and
    the kv_cache resume) only ``/server_info``, a round trip to its scheduler that generates nothing:
    sglang runs the health request on the released KV pool, an illegal memory access on a GPU."""
    # a busy engine answers /health_generate only after its running request: give it time
    return [
        e
        for e, c in enumerate(engine.clients)
        if not (c.alive(timeout_s=HEALTH_TIMEOUT_S) if engine.released[e] else c.health(timeout_s=HEALTH_TIMEOUT_S))
    ]
