"""SGLang rollout engine (GPU; on CPU the same code drives ``cpu_server``): G samples per
prompt from token ids, with log-probs.

Drives one or more SGLang HTTP servers through :mod:`gspo_megatron.engines.sglang_client`. Called on
global rank 0 only; where the servers run and who starts them is ``fleet.engine_fleet``'s job.
With a router URL, requests go to the SGLang router; otherwise each prompt's G samples go to one
engine (they share the prefix cache), prompts spread round-robin over the engines, one ``/generate``
request per prompt (its G samples as a batch). Through the router every sample is its own request:
the router's ``/generate`` takes one sampling-params object per request, not a list.

Weight updates travel through the transports (``weight_sync.cuda_ipc`` / ``weight_sync.nccl_broadcast``);
``begin_weight_update`` / ``end_weight_update`` here bracket them with the one pause / flush / session
sequence (``sglang_client.open_weight_update`` / ``close_weight_update``) that the transports use too.

Colocation: ``release_memory`` frees weights and KV cache (tags ``weights``, ``kv_cache``) while the
trainer runs; ``resume_memory(["weights"])`` before a sync and ``resume_memory(["kv_cache"])`` after
it keeps the peak low.

Log-probs: SGLang reports log softmax(logits / temperature) of the sampled token, before top-p/top-k
filtering (``srt/layers/sampler.py``), matching ``SamplingParams``' contract. Seeds: SGLang honours a
request's ``sampling_seed`` only when the server runs with ``--enable-deterministic-inference``
(``srt/sampling/sampling_batch_info.py``), so seeds are sent only when ``send_seeds`` says the
engines were started that way (``rollout.engine_deterministic``).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, Sequence

from gspo_megatron.engines.base import RolloutEngine, RolloutSample, SamplingParams
from gspo_megatron.engines.routing import (
    INDEXER_META_KEY,
    META_KEY,
    decode_indexer_topk,
    decode_routed_experts,
    route_tokens,
)
from gspo_megatron.engines.sglang_client import SGLangError, SGLangHttpClient, close_weight_update, open_weight_update
from gspo_megatron.runtime import stop

MEMORY_TAGS = ("weights", "kv_cache")
ROUTES_KEY = "_routed_experts_decoded"  # an answer's decoded routes, set by SGLangRolloutEngine._dispatch
INDEXER_KEY = "_indexer_topk_decoded"  # an answer's decoded indexer selection (DSA models), likewise


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


def wait_until_healthy(
    client: SGLangHttpClient, proc: subprocess.Popen | None, timeout_s: float, log_path: str | None = None
) -> None:
    """Poll ``/health_generate`` until it answers; raise naming the URL (and log) on death/timeout,
    and :class:`runtime.stop.Stopped` when a stop signal arrives meanwhile (``runtime/stop.py``)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.25  # a CPU stand-in is up in seconds, a GPU server in minutes: poll often first, then every 2 s
    while time.monotonic() < deadline:
        stop.check(f"SGLang server {client.base_url} to start")
        if client.health(timeout_s=5.0):
            return
        if proc is not None and proc.poll() is not None:
            raise SGLangError(
                f"SGLang server for {client.base_url} exited with code {proc.returncode}"
                + (f"; see {log_path}" if log_path else "")
            )
        time.sleep(pause)
        pause = min(2.0, 2 * pause)
    raise SGLangError(
        f"SGLang server {client.base_url} not healthy after {timeout_s:.0f}s"
        + (f"; see {log_path}" if log_path else "")
    )


def launch_server(
    server_args: dict[str, Any],
    *,
    module: str = "sglang.launch_server",
    log_path: str | None = None,
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    extra_cli: Sequence[str] = (),
) -> subprocess.Popen:
    """Start ``python -m <module>`` (``sglang.launch_server``, or the CPU stand-in
    ``gspo_megatron.cpu_server`` that takes the same flags); returns at once (see
    :func:`wait_until_healthy`). The server runs in its own process group (so that
    :func:`kill_server` takes its workers too) and dies with this process.

    ``server_args`` must hold ``model_path``, ``host`` and ``port``. PYTORCH_CUDA_ALLOC_CONF is
    dropped from the child's environment (SGLang's memory saver does not support expandable
    segments), and so are torchrun's variables (:func:`without_torchrun_env`).
    """
    for key in ("model_path", "host", "port"):
        if key not in server_args:
            raise ValueError(f"launch_server: server_args is missing {key!r}")
    child_env = without_torchrun_env(dict(os.environ if env is None else env))
    child_env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    child_env.pop("PYTORCH_ALLOC_CONF", None)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # owned by the child
    from gspo_megatron.runtime import children

    argv = [python, "-m", module, *server_args_to_cli(server_args), *extra_cli]
    return subprocess.Popen(
        children.dying_with_this_process(argv),
        stdout=out,
        stderr=subprocess.STDOUT,
        env=child_env,
        start_new_session=True,
    )


TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def without_torchrun_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` less the variables torchrun gives a training rank. A server started from a rank must
    not inherit them: with ``TORCHELASTIC_USE_AGENT_STORE=True`` every ``tcp://`` rendezvous in it
    (SGLang's TP group, its weight-update groups) connects as a client to a store nobody serves, and
    hangs."""
    return {k: v for k, v in env.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}


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


def params_for(params: SamplingParams, i: int, n: int, send_seeds: bool) -> SamplingParams:
    """Prompt i's params in a stream of one-prompt calls: its seeds are those it gets in one
    ``generate`` of every prompt (``seed + i*n + j``)."""
    if params.seed is None or not send_seeds:
        return params
    return dataclasses.replace(params, seed=params.seed + i * n)


def parse_output(prompt_ids: Sequence[int], out: dict, allow_abort: bool = False) -> RolloutSample:
    """One SGLang generate output -> RolloutSample. Response ids come from
    ``meta_info.output_token_logprobs`` ((logprob, token_id, text) per generated token, stop token
    included), so ids and log-probs line up by construction. ``allow_abort``: an answer that a
    ``/pause_generation`` in ``abort`` mode cut short (``finish_reason`` type ``"abort"``) is the
    partial output, ``finish_reason`` ``"abort"`` (``engines.partial``); otherwise it is an error."""
    meta = out.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("stop", "length") and not (allow_abort and kind == "abort"):
        raise SGLangError(f"generation did not finish normally (finish_reason={finish!r})")
    entries = meta.get("output_token_logprobs")
    if entries is None and kind == "abort" and not out.get("output_ids"):
        entries = []  # aborted before any token reached the tokenizer manager
    if entries is None:
        raise SGLangError("SGLang output has no meta_info.output_token_logprobs (return_logprob not honoured)")
    ids = [int(e[1]) for e in entries]
    logps = [float(e[0]) for e in entries]
    if "output_ids" in out and list(out["output_ids"]) != ids:
        raise SGLangError(f"output_ids {out['output_ids']} disagree with output_token_logprobs ids {ids}")
    return RolloutSample(
        prompt_ids=list(prompt_ids),
        response_ids=ids,
        response_logprobs=logps,
        finish_reason=kind,
        token_versions=token_versions(meta, len(ids)),
        routed_experts=out.get(ROUTES_KEY),
        indexer_topk=out.get(INDEXER_KEY),
        **spec_counts(meta),
    )


def spec_counts(meta: dict) -> dict[str, int]:
    """A speculatively decoding engine's counts of one response from sglang 0.5.23's ``meta_info``
    (``managers/tokenizer_manager.py`` ``_calculate_spec_decoding_metrics``, written only when the request
    had a verify forward): ``spec_verify_ct``, ``spec_num_correct_drafts``, ``spec_num_proposed_drafts``
    (RolloutSample's fields; 0 when absent)."""
    keys = ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts")
    return {k: int(meta.get(k) or 0) for k in keys}


def engine_spec_metrics(samples) -> dict[str, float]:
    """A step's engine-side speculative metrics from its samples (``RolloutSample`` or ``sample.Sample``,
    which carry :func:`spec_counts`' fields): ``spec/engine_accept_length`` = sum of response tokens / sum
    of ``spec_verify_ct`` (sglang's ``spec_accept_length``, the bonus token included) and
    ``spec/engine_accept_rate`` = sum of ``spec_num_correct_drafts`` / sum of ``spec_num_proposed_drafts``
    (``spec_accept_rate``), over the samples that had a verify forward (``spec_verify_ct > 0``; a response
    of the prefill's token alone has none, as in sglang's ``_calculate_spec_decoding_metrics``). Empty
    when no sample did (no speculation)."""
    rows = [s for s in samples if int(getattr(s, "spec_verify_ct", 0) or 0) > 0]
    if not rows:
        return {}
    verify = sum(int(s.spec_verify_ct) for s in rows)
    out = {"spec/engine_accept_length": sum(len(s.response_ids) for s in rows) / verify}
    proposed = sum(int(s.spec_num_proposed_drafts or 0) for s in rows)
    if proposed:
        out["spec/engine_accept_rate"] = sum(int(s.spec_num_correct_drafts or 0) for s in rows) / proposed
    return out


def token_versions(meta: dict, n: int) -> list[str] | None:
    """The weight version that produced each of the ``n`` response tokens, from sglang 0.5.23's
    ``meta_info.weight_versions`` spans (``[{version, start, end}]``, end exclusive, set on finished
    requests: ``srt/utils/weight_versions.py``; a request that lived through a weight update has
    more than one span); without spans, ``meta_info.weight_version`` for every token; None when the
    server reports neither."""
    spans = meta.get("weight_versions")
    if spans:
        out: list[str | None] = [None] * n
        for sp in spans:
            for t in range(int(sp["start"]), min(int(sp["end"]), n)):
                out[t] = str(sp["version"])
        covered = [v for v in out if v is not None]
        if len(covered) != n:
            raise SGLangError(f"meta_info.weight_versions {spans} does not cover the {n} response tokens")
        return covered
    version = meta.get("weight_version")
    return None if version is None else [str(version)] * n


class SGLangRolloutEngine(RolloutEngine):
    """G samples per prompt over one or more SGLang engines (global rank 0).

    clients: one ``SGLangHttpClient`` per engine (or any object with its methods). router: optional
    client of the SGLang router, used for generation only. send_seeds: send per-sample
    ``sampling_seed`` (only meaningful with deterministic-inference servers, see the module docstring).
    route_spec: ``engines.routing.RouteSpec`` of the policy model when routing replay is on (R3):
    every request asks for its routed experts, each answer's are decoded and validated here
    (``RoutedExpertsError`` names the engine and the request) and land on ``RolloutSample.routed_experts``.
    """

    def __init__(
        self,
        clients: Sequence[Any],
        *,
        router: Any = None,
        max_concurrency: int = 64,
        memory_tags: Sequence[str] = MEMORY_TAGS,
        send_seeds: bool = False,
        route_spec: Any = None,
    ):
        if not clients:
            raise ValueError("SGLangRolloutEngine: clients is empty")
        self.clients = list(clients)
        self.router = router
        self.max_concurrency = max(1, int(max_concurrency))
        self.memory_tags = list(memory_tags)
        self.send_seeds = send_seeds
        self.route_spec = route_spec
        self.served = [0] * len(self.clients)  # generate requests answered per engine (not the router)
        self.released: list[set[str]] = [set() for _ in self.clients]  # memory tags each engine released
        # rollout.lora_sync=adapter: the sglang LoRA adapter every request names (weight_sync/lora_adapter.py)
        self.lora_path: str | None = None

    @classmethod
    def attach(
        cls,
        urls: Sequence[str],
        *,
        router_url: str | None = None,
        api_key: str | None = None,
        wait_timeout_s: float = 0.0,
        **kw,
    ) -> "SGLangRolloutEngine":
        """Use servers someone else started (e.g. the Slurm script's SGLang nodes); with
        ``wait_timeout_s`` > 0, wait until every server (and the router) is healthy."""
        clients = [SGLangHttpClient(u, api_key=api_key) for u in urls]
        router = SGLangHttpClient(router_url, api_key=api_key) if router_url else None
        if wait_timeout_s > 0:
            for c in clients + ([router] if router else []):
                wait_until_healthy(c, None, wait_timeout_s)
        return cls(clients, router=router, **kw)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams) -> list[list[RolloutSample]]:
        """Each prompt repeated n times (per-sample seeds ``seed + i*n + j`` when seeds are sent)."""
        return self._generate(prompts, n, params, targets=[self.router] if self.router is not None else self.clients)

    def generate_stream(self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams):
        """Each prompt's group as soon as its request returns; closing the iterator cancels the
        requests not yet sent (those in flight finish and are dropped)."""
        targets = [self.router] if self.router is not None else self.clients
        if n < 1:
            raise ValueError(f"generate: n must be >= 1, got {n}")
        pool = ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrency, len(prompts))))
        try:
            futures = {
                pool.submit(
                    self._generate, [p], n, params_for(params, i, n, self.send_seeds), [targets[i % len(targets)]]
                ): i
                for i, p in enumerate(prompts)
            }
            for fut in as_completed(futures):
                yield [(futures[fut], fut.result()[0])]
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def generate_partial(
        self, inputs: Sequence[Sequence[int]], params: Sequence[SamplingParams], index: int
    ) -> list[RolloutSample]:
        """One request with every input (its own sampling params each) to engine ``index`` modulo the
        engines (the router when there is one); answers cut short by an ``abort`` pause come back as
        partial outputs (``finish_reason`` ``"abort"``). ``engines.partial.generate_group`` continues them."""
        targets = [self.router] if self.router is not None else self.clients
        ids = [list(p) for p in inputs]
        if not ids or any(len(p) == 0 for p in ids):
            raise ValueError("generate_partial: every input needs at least one token")
        sps = [to_sglang_sampling_params(p, p.seed if self.send_seeds else None) for p in params]
        outputs = self._dispatch(ids, sps, len(ids), [targets[index % len(targets)]])
        return [parse_output(i, o, allow_abort=True) for i, o in zip(ids, outputs)]

    def generate_on_each(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[RolloutSample]]:
        """One sample per prompt from every engine (not the router): [engine][prompt] (sync checks)."""
        return [[g[0] for g in self._generate(prompts, 1, params, targets=[c])] for c in self.clients]

    def _generate(self, prompts, n: int, params: SamplingParams, targets: list) -> list[list[RolloutSample]]:
        if n < 1:
            raise ValueError(f"generate: n must be >= 1, got {n}")
        flat_ids, flat_sp, owner = [], [], []
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty")
            for j in range(n):
                seed = None if params.seed is None or not self.send_seeds else params.seed + i * n + j
                flat_ids.append(list(p))
                flat_sp.append(to_sglang_sampling_params(params, seed))
                owner.append(i)
        outputs = self._dispatch(flat_ids, flat_sp, n, targets)
        result: list[list[RolloutSample]] = [[] for _ in prompts]
        for k, out in enumerate(outputs):
            result[owner[k]].append(parse_output(flat_ids[k], out))
        return result

    def _dispatch(self, ids: list[list[int]], sps: list[dict], n: int, targets: list) -> list[dict]:
        """One request per prompt group (its n samples batched), groups round-robin over ``targets``,
        concurrently."""
        groups = [list(range(s, s + n)) for s in range(0, len(ids), n)]
        outputs: list[dict | None] = [None] * len(ids)

        def run(g: int) -> None:
            idx = groups[g]
            target = targets[g % len(targets)]
            kw: dict[str, Any] = {"return_routed_experts": True} if self.route_spec is not None else {}
            if self.route_spec is not None and bool(getattr(self.route_spec, "index_topk", 0)):
                kw["return_indexer_topk"] = True
            if self.lora_path is not None:
                kw["lora_path"] = self.lora_path
            res = target.generate(
                [ids[k] for k in idx], [sps[k] for k in idx], return_logprob=True, batch=target is not self.router, **kw
            )
            if len(res) != len(idx):
                raise SGLangError(f"{target} returned {len(res)} outputs for {len(idx)} inputs")
            for k, r in zip(idx, res):
                if self.route_spec is not None:
                    r = dict(r, **{ROUTES_KEY: self._routes(target, k, ids[k], r)})
                    if getattr(self.route_spec, "index_topk", 0):
                        r[INDEXER_KEY] = self._indexer(target, k, ids[k], r)
                outputs[k] = r
            if target in self.clients:
                self.served[self.clients.index(target)] += 1

        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(groups))) as pool:
            list(pool.map(run, range(len(groups))))
        done = [o for o in outputs if o is not None]
        if len(done) != len(ids):  # every group's run filled its outputs or raised
            raise SGLangError(f"{len(done)} outputs for {len(ids)} inputs")
        return done

    def _routes(self, target: Any, k: int, prompt: list[int], out: dict):
        """The decoded, validated routes of one answer: int32 [P + R - 1, layers, topk]."""
        meta = out.get("meta_info") or {}
        n_out = len(meta.get("output_token_logprobs") or out.get("output_ids") or [])
        spec = self.route_spec
        return decode_routed_experts(
            meta.get(META_KEY),
            num_tokens=route_tokens(len(prompt), n_out),
            num_layers=spec.num_layers,
            topk=spec.topk,
            num_experts=spec.num_experts,
            engine=getattr(target, "base_url", str(target)),
            request=f"{meta.get('id', '?')} (input {k} of the call)",
            moe_layers=getattr(spec, "moe_layers", None),
        )

    def _indexer(self, target: Any, k: int, prompt: list[int], out: dict):
        """The decoded, validated indexer selection of one answer (DSA): int32 [P + R - 1, layers, index_topk]."""
        meta = out.get("meta_info") or {}
        n_out = len(meta.get("output_token_logprobs") or out.get("output_ids") or [])
        spec = self.route_spec
        return decode_indexer_topk(
            meta.get(INDEXER_META_KEY),
            num_tokens=route_tokens(len(prompt), n_out),
            num_layers=spec.num_layers,
            index_topk=spec.index_topk,
            engine=getattr(target, "base_url", str(target)),
            request=f"{meta.get('id', '?')} (input {k} of the call)",
        )

    def take_served(self) -> list[int]:
        """Requests each engine answered since the last call (the router's are not attributed)."""
        out, self.served = self.served, [0] * len(self.clients)
        return out

    # -- weight updates (the buckets travel through a transport) ------------------------------------
    def begin_weight_update(self) -> None:
        for c in self.clients:
            open_weight_update(c)

    def end_weight_update(self) -> None:
        for c in self.clients:
            close_weight_update(c)

    def weight_versions(self) -> list[str | None]:
        """Each engine's current weight version (``/model_info``'s ``weight_version``)."""
        return [c.weight_version() for c in self.clients]

    # -- colocation ------------------------------------------------------------------------------
    def release_memory(self, tags: Sequence[str] | None = None, engines: Sequence[int] | None = None) -> None:
        """Release ``tags`` (default: all memory tags) on ``engines`` (default: all)."""
        tags = list(tags) if tags is not None else self.memory_tags
        for i, c in enumerate(self.clients):
            if engines is not None and i not in engines:
                continue
            c.flush_cache()
            c.release_memory_occupation(tags)
            self.released[i] |= set(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> list[int]:
        """Resume ``tags`` (default: all memory tags) on the engines that released them; returns
        those engines. Order for a sync: weights, sync, kv_cache; nothing generates (the sync check,
        ``/health_generate``) before the kv_cache is back."""
        resumed = []
        for i, c in enumerate(self.clients):
            want = [t for t in (tags if tags is not None else self.memory_tags) if t in self.released[i]]
            if want:
                c.resume_memory_occupation(want)
                self.released[i] -= set(want)
                resumed.append(i)
        return resumed

    def engine_restarted(self, index: int) -> None:
        """Engine ``index`` was started again: it holds its memory (nothing to resume)."""
        self.released[index] = set()

    def health_check(self) -> bool:
        return all(c.health() for c in self.clients)


def kill_server(proc: Any) -> None:
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
