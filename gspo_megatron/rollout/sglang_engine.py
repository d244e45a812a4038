"""SGLang rollout engine (GPU): G samples per prompt from token ids, with log-probs.

Drives one or more SGLang engines through :mod:`gspo_megatron.rollout.sglang_client` (HTTP servers,
or ``sglang.Engine`` in this process). Called on global rank 0 only (see ``rollout.base``). With a
router URL, requests go to the SGLang router; otherwise samples are spread over the engines
round-robin by prompt (a prompt's G samples stay on one engine so they share the prefix cache).

Weight updates: ``begin_weight_update`` pauses generation, flushes the KV/radix cache and opens
SGLang's weight-update session (newer versions refuse updates outside one); ``end_weight_update``
closes it and continues generation. The buckets themselves travel through a transport
(``weight_sync.cuda_ipc`` / ``weight_sync.nccl_broadcast``); ``update_weights`` here is the
single-process CUDA-IPC path (trainer and engine on one node, tensors on a GPU).

Colocation: ``release_memory`` frees weights and KV cache (tags ``weights``, ``kv_cache``) while the
trainer runs; ``resume_memory(["weights"])`` before a sync and ``resume_memory(["kv_cache"])`` after
it keeps the peak low.

Log-probs: SGLang reports log softmax(logits / temperature) of the sampled token, before top-p/top-k
filtering (``srt/layers/sampler.py``), matching ``SamplingParams``' contract.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import torch

from gspo_megatron.rollout.base import RolloutEngine, RolloutSample, SamplingParams
from gspo_megatron.rollout.sglang_client import SGLangError, SGLangHttpClient, SGLangInProcessClient

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache")


def server_args_to_cli(server_args: dict[str, Any]) -> list[str]:
    """``{"model_path": "x", "tp_size": 2, "enable_memory_saver": True}`` ->
    ``["--model-path", "x", "--tp-size", "2", "--enable-memory-saver"]`` (False/None dropped)."""
    cli: list[str] = []
    for key, value in server_args.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            cli.append(flag)
        elif isinstance(value, (list, tuple)):
            cli += [flag, *map(str, value)]
        else:
            cli += [flag, str(value)]
    return cli


def wait_until_healthy(client: SGLangHttpClient, proc: subprocess.Popen | None, timeout_s: float,
                       log_path: str | None = None) -> None:
    """Poll ``/health_generate`` until it answers; raise naming the URL (and log) on death/timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.health(timeout_s=5.0):
            return
        if proc is not None and proc.poll() is not None:
            raise SGLangError(f"SGLang server for {client.base_url} exited with code {proc.returncode}"
                              + (f"; see {log_path}" if log_path else ""))
        time.sleep(2.0)
    raise SGLangError(f"SGLang server {client.base_url} not healthy after {timeout_s:.0f}s"
                      + (f"; see {log_path}" if log_path else ""))


def launch_server(server_args: dict[str, Any], *, log_path: str | None = None,
                  python: str = sys.executable, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m sglang.launch_server`` (returns at once; see :func:`wait_until_healthy`).

    ``server_args`` must hold ``model_path``, ``host`` and ``port``. PYTORCH_CUDA_ALLOC_CONF is
    dropped from the child's environment: SGLang's memory saver does not support expandable segments.
    """
    for key in ("model_path", "host", "port"):
        if key not in server_args:
            raise ValueError(f"launch_server: server_args is missing {key!r}")
    child_env = dict(os.environ if env is None else env)
    child_env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    child_env.pop("PYTORCH_ALLOC_CONF", None)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 (owned by the child)
    return subprocess.Popen([python, "-m", "sglang.launch_server", *server_args_to_cli(server_args)],
                            stdout=out, stderr=subprocess.STDOUT, env=child_env, start_new_session=True)


def launch_router(worker_urls: Sequence[str], *, host: str = "127.0.0.1", port: int = 30000,
                  policy: str = "cache_aware", log_path: str | None = None,
                  python: str = sys.executable) -> subprocess.Popen:
    """Start the SGLang router (``python -m sglang_router.launch_router``) over ``worker_urls``."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    cmd = [python, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
           "--host", host, "--port", str(port), "--policy", policy]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def to_sglang_sampling_params(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """Our SamplingParams -> SGLang's sampling_params dict (``srt/sampling/sampling_params.py``)."""
    sp: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_new_tokens": params.max_new_tokens,
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    if params.stop_token_ids:
        sp["stop_token_ids"] = list(params.stop_token_ids)
    if seed is not None:
        sp["sampling_seed"] = int(seed)
    return sp


def parse_output(prompt_ids: Sequence[int], out: dict) -> RolloutSample:
    """One SGLang generate output -> RolloutSample. Response ids come from
    ``meta_info.output_token_logprobs`` ((logprob, token_id, text) per generated token, stop token
    included), so ids and log-probs line up by construction."""
    meta = out.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length"):
        raise SGLangError(f"generation did not finish normally (finish_reason={finish!r})")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise SGLangError("SGLang output has no meta_info.output_token_logprobs (return_logprob not honoured)")
    ids = [int(e[1]) for e in entries]
    logps = [float(e[0]) for e in entries]
    if "output_ids" in out and list(out["output_ids"]) != ids:
        raise SGLangError(f"output_ids {out['output_ids']} disagree with output_token_logprobs ids {ids}")
    return RolloutSample(prompt_ids=list(prompt_ids), response_ids=ids, response_logprobs=logps,
                         finish_reason=kind)


class SGLangRolloutEngine(RolloutEngine):
    """G samples per prompt over one or more SGLang engines.

    clients: one per engine (SGLangHttpClient / SGLangInProcessClient, or any object with their
    methods). router: optional client for the SGLang router used for generation only.
    processes: server processes this object launched (killed on shutdown / restart).
    relaunch: per engine, a zero-arg callable that starts the server again and returns
    (client, process); enables ``restart``.
    """

    def __init__(self, clients: Sequence[Any], *, router: Any = None, processes: Sequence[Any] = (),
                 relaunch: Sequence[Any] | None = None, max_concurrency: int = 64,
                 memory_tags: Sequence[str] = MEMORY_TAGS):
        if not clients:
            raise ValueError("SGLangRolloutEngine: clients is empty")
        self.clients = list(clients)
        self.router = router
        self.processes = list(processes)
        self.relaunch = list(relaunch) if relaunch is not None else None
        self.max_concurrency = max(1, int(max_concurrency))
        self.memory_tags = list(memory_tags)
        self.weight_version = 0

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def attach(cls, urls: Sequence[str], *, router_url: str | None = None, api_key: str | None = None,
               wait_timeout_s: float = 0.0, **kw) -> "SGLangRolloutEngine":
        """Use servers someone else started (e.g. the Slurm script's SGLang nodes); with
        ``wait_timeout_s`` > 0, wait until every server (and the router) is healthy."""
        clients = [SGLangHttpClient(u, api_key=api_key) for u in urls]
        router = SGLangHttpClient(router_url, api_key=api_key) if router_url else None
        if wait_timeout_s > 0:
            for c in clients + ([router] if router else []):
                wait_until_healthy(c, None, wait_timeout_s)
        return cls(clients, router=router, **kw)

    @classmethod
    def launch(cls, model_path: str, *, num_engines: int = 1, tp_size: int = 1, host: str = "127.0.0.1",
               base_port: int = 30000, base_gpu_id: int = 0, colocated: bool = False,
               mem_fraction_static: float | None = None, extra_server_args: dict[str, Any] | None = None,
               use_router: bool | None = None, router_port: int | None = None, log_dir: str | None = None,
               wait_timeout_s: float = 1800.0, **kw) -> "SGLangRolloutEngine":
        """Start ``num_engines`` HTTP servers on this node (engine i on GPUs
        ``base_gpu_id + i*tp_size ...``), plus a router when several (``use_router`` default)."""
        procs, clients, relaunch = [], [], []
        for i in range(num_engines):
            args: dict[str, Any] = dict(model_path=model_path, host=host, port=base_port + 10 * i,
                                        tp_size=tp_size, base_gpu_id=base_gpu_id + i * tp_size,
                                        enable_memory_saver=colocated, skip_server_warmup=True,
                                        mem_fraction_static=mem_fraction_static)
            args.update(extra_server_args or {})
            log = os.path.join(log_dir, f"sglang_engine{i}.log") if log_dir else None

            def start(args=args, log=log):
                proc = launch_server(args, log_path=log)
                client = SGLangHttpClient(f"http://{host}:{args['port']}")
                wait_until_healthy(client, proc, wait_timeout_s, log)
                return client, proc

            relaunch.append(start)
            procs.append(None)
            clients.append(None)
        for i, start in enumerate(relaunch):
            clients[i], procs[i] = start()
        router = None
        if use_router if use_router is not None else num_engines > 1:
            rport = router_port or base_port + 10 * num_engines
            log = os.path.join(log_dir, "sglang_router.log") if log_dir else None
            procs.append(launch_router([c.base_url for c in clients], host=host, port=rport, log_path=log))
            router = SGLangHttpClient(f"http://{host}:{rport}")
            wait_until_healthy(router, procs[-1], 300.0, log)
        return cls(clients, router=router, processes=procs, relaunch=relaunch, **kw)

    @classmethod
    def in_process(cls, **server_args: Any) -> "SGLangRolloutEngine":
        """One ``sglang.Engine`` in this process (tests, single node)."""
        return cls([SGLangInProcessClient(**server_args)])

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], n: int,
                 params: SamplingParams) -> list[list[RolloutSample]]:
        """Each prompt repeated n times (per-sample seeds ``seed + i*n + j`` when seeded)."""
        if n < 1:
            raise ValueError(f"generate: n must be >= 1, got {n}")
        flat_ids, flat_sp, owner = [], [], []
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty")
            for j in range(n):
                seed = None if params.seed is None else params.seed + i * n + j
                flat_ids.append(list(p))
                flat_sp.append(to_sglang_sampling_params(params, seed))
                owner.append(i)
        outputs = self._dispatch(flat_ids, flat_sp, n)
        result: list[list[RolloutSample]] = [[] for _ in prompts]
        for k, out in enumerate(outputs):
            result[owner[k]].append(parse_output(flat_ids[k], out))
        return result

    def _dispatch(self, ids: list[list[int]], sps: list[dict], n: int) -> list[dict]:
        """Send requests; HTTP targets get one request per prompt group, concurrently."""
        groups = [list(range(s, s + n)) for s in range(0, len(ids), n)]
        targets = [self.router] if self.router is not None else self.clients
        if all(isinstance(t, SGLangInProcessClient) for t in targets):
            return targets[0].generate(ids, sps, return_logprob=True)
        outputs: list[dict | None] = [None] * len(ids)

        def run(g: int) -> None:
            idx = groups[g]
            target = targets[g % len(targets)]
            res = target.generate([ids[k] for k in idx], [sps[k] for k in idx], return_logprob=True)
            if len(res) != len(idx):
                raise SGLangError(f"{target} returned {len(res)} outputs for {len(idx)} inputs")
            for k, r in zip(idx, res):
                outputs[k] = r

        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(groups))) as pool:
            list(pool.map(run, range(len(groups))))
        return outputs  # type: ignore[return-value]

    # -- weight updates --------------------------------------------------------------------------
    def begin_weight_update(self) -> None:
        """Pause, flush the cache (the old weights' KV entries), open the update session."""
        self.weight_version += 1
        for c in self.clients:
            c.pause_generation()
            c.flush_cache()
            c.begin_weight_update()

    def end_weight_update(self) -> None:
        for c in self.clients:
            c.end_weight_update()
            c.flush_cache()
            c.continue_generation()

    def update_weights(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Single-process CUDA-IPC update of every engine (tensors must live on a GPU of this node)."""
        from gspo_megatron.weight_sync.cuda_ipc import serialize_bucket

        for c in self.clients:
            for payload in serialize_bucket(bucket):
                c.update_weights_from_tensor([payload] * c.tp_size, load_format=payload_format(),
                                             flush_cache=False, weight_version=str(self.weight_version))

    # -- colocation ------------------------------------------------------------------------------
    def release_memory(self) -> None:
        for c in self.clients:
            c.flush_cache()
            c.release_memory_occupation(self.memory_tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Resume ``tags`` (default: all memory tags). Order for a sync: weights, sync, kv_cache."""
        for c in self.clients:
            c.resume_memory_occupation(list(tags) if tags is not None else self.memory_tags)

    # -- lifecycle -------------------------------------------------------------------------------
    def health_check(self) -> bool:
        return all(c.health() for c in self.clients)

    def restart(self) -> None:
        """Kill and relaunch every unhealthy engine; weights must be re-synced afterwards."""
        if self.relaunch is None:
            raise RuntimeError("SGLangRolloutEngine.restart: engines were attached, not launched here")
        for i, c in enumerate(self.clients):
            if c.health():
                continue
            logger.warning("restarting SGLang engine %d (%s)", i, c)
            _kill(self.processes[i])
            self.clients[i], self.processes[i] = self.relaunch[i]()

    def shutdown(self) -> None:
        for c in self.clients:
            try:
                c.shutdown()
            except Exception as e:  # keep shutting the others down
                logger.warning("shutdown of %s failed: %s", c, e)
        for p in self.processes:
            _kill(p)
        self.processes = []

    def weight_prefix(self, name: str, truncate_size: int = 100, engine: int = 0) -> torch.Tensor:
        """Leading rows of TP rank 0's shard of HF tensor ``name`` on ``engine``
        (SGLang's ``get_weights_by_name``), as float32; see ``weight_sync.verify``."""
        return torch.tensor(self.clients[engine].get_weights_by_name(name, truncate_size), dtype=torch.float32)

    def weight_checksums(self, names: Iterable[str]) -> dict[str, float]:
        """Unsupported: SGLang exposes no full-tensor read in HF names (get_weights_by_name is
        truncated and per TP shard; /weights_checker hashes its own fused parameters).
        ``weight_sync.verify.verify_engine_prefixes`` compares ``weight_prefix`` blocks instead."""
        raise NotImplementedError(
            "SGLang cannot return full HF-named tensors; use weight_sync.verify.verify_engine_prefixes"
        )


def payload_format() -> str | None:
    """``"flattened_bucket"`` when sglang's FlattenedTensorBucket is importable, else None."""
    from gspo_megatron.weight_sync.cuda_ipc import flattened_bucket_class

    return "flattened_bucket" if flattened_bucket_class() is not None else None


def _kill(proc: Any) -> None:
    """Terminate a server process we started (and its process group: SGLang spawns workers)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, 15)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
