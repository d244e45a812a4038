"""Colocated memory order against the CPU server with its memory saver on (issue 21, defects 4 and 9).

sglang 0.5.23 runs any request, the one-token request of ``/health_generate`` included, on whatever
its KV pool and weights map; after ``release_memory_occupation`` that memory is unmapped (an illegal
memory access on a GPU). The CPU server refuses instead (``/generate`` 400, ``/health_generate`` 503),
so a session that probes an engine before its KV cache is back fails here:

- ``rollout.sync_verify`` with the KV cache resumed right after the sync (the default), and with
  ``rollout.offload_train`` (the training state leaves, the KV cache comes back for the probe and is
  released again before the state returns);
- the dead-engine check of an engine whose memory is released asks ``/server_info`` (no generation);
- the server's sampling stream is not reseeded by release / resume (sglang seeds once at start).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cpu_server_util import CpuServer
from gspo_megatron.engines.sglang_client import SGLangError, SGLangHttpClient
from gspo_megatron.engines.sglang_engine import SGLangRolloutEngine
from gspo_megatron.fleet.engine_fleet import dead_engines
from gspo_megatron.orchestration.colocation import Colocation
from gspo_megatron.orchestration.probe import SyncVerifier
from gspo_megatron.orchestration.session import RolloutSession
from gspo_megatron.weight_sync.cuda_ipc import serialize_bucket

PROMPTS = [[5, 17, 42, 9], [100, 3]]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    s = CpuServer(model_dir, str(tmp_path_factory.mktemp("logs")), tp=1, extra=("--enable-memory-saver",))
    yield s
    s.stop()


@pytest.fixture
def requests_log(monkeypatch):
    """Every HTTP call the project's client makes: (route, payload)."""
    log: list[tuple[str, object]] = []
    real = SGLangHttpClient.request

    def spy(self, method, route, payload=None, timeout_s=None):
        log.append((route.lstrip("/"), payload))
        return real(self, method, route, payload, timeout_s)

    monkeypatch.setattr(SGLangHttpClient, "request", spy)
    return log


@pytest.fixture
def scored_by_transformers(monkeypatch, model_dir):
    """The trainer's side of the probe: transformers' forward of the checkpoint (fp32)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def score_rows(_model, rows, pad_id=0, **kw):
        out = []
        with torch.no_grad():
            for r in rows:
                ids = torch.tensor([list(r)])
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                out.append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        return out

    monkeypatch.setattr("gspo_megatron.score.score_rows", score_rows)


class PushSyncer:
    """The checkpoint's weights pushed as the colocated transport does (one payload per TP rank)."""

    def __init__(self, engine: SGLangRolloutEngine, state: dict):
        self.engine, self.state, self.version, self.errors = engine, state, 0, []

    def sync(self) -> dict:
        self.version += 1
        self.engine.begin_weight_update()
        for payload in serialize_bucket(sorted(self.state.items())):
            self.engine.clients[0].update_weights_from_tensor(
                [payload], load_format="flattened_bucket", weight_version=str(self.version)
            )
        self.engine.end_weight_update()
        return {}


class RecordingOffloader:
    def __init__(self, log):
        self.log, self.offloaded = log, False

    def offload(self):
        assert not self.offloaded
        self.offloaded = True
        self.log.append(("offload", None))

    def reload(self):
        assert self.offloaded
        self.offloaded = False
        self.log.append(("reload", None))


def released_tags(url: str) -> set[str]:
    return set(SGLangHttpClient(url).request("GET", "cpu_server/memory")["ranks"][0]["offload_tags"])


def session_for(server, saved, offloader=None, verify_every: int = 1) -> RolloutSession:
    engine = SGLangRolloutEngine([SGLangHttpClient(server.url, timeout_s=120)])

    def no_restart(dead):
        raise AssertionError(f"engines {dead} restarted: the session generated on released memory")

    return RolloutSession(
        PushSyncer(engine, saved),
        engine,
        collector=None,
        max_restarts=0,
        dead_engines=lambda: dead_engines(engine),
        restart=no_restart,
        colocation=Colocation(engine, colocated=True, offloader=offloader),
        verifier=SyncVerifier(None, 1e-4, 0, probe_prompts=PROMPTS, every=verify_every),
    )


def _index(log, route, tags=None):
    for i, (r, payload) in enumerate(log):
        if r == route and (tags is None or (payload or {}).get("tags") == tags):
            return i
    raise AssertionError(f"no {route} {tags or ''} in {[r for r, _ in log]}")


def test_server_refuses_generation_and_health_while_memory_is_released(server):
    client = SGLangHttpClient(server.url, timeout_s=120)
    engine = SGLangRolloutEngine([client])
    assert client.health()
    engine.release_memory()
    assert released_tags(server.url) == {"weights", "kv_cache"}
    engine.resume_memory(["weights"])
    with pytest.raises(SGLangError, match="'kv_cache' released"):
        client.generate([PROMPTS[0]], [{"max_new_tokens": 2}])
    assert not client.health(timeout_s=30)  # /health_generate: 503 (sglang: its request would crash the scheduler)
    assert client.alive()  # /server_info generates nothing
    assert dead_engines(engine) == []  # a released engine is asked /server_info, not /health_generate
    engine.resume_memory(["kv_cache"])
    assert released_tags(server.url) == set() and client.health()


def test_colocated_sync_verify_probes_with_the_kv_cache_resumed(server, saved, requests_log, scored_by_transformers):
    session = session_for(server, saved)
    session.colocation.release_engines()
    metrics = session.sync()
    assert metrics["sync/verify_max_abs_diff"] <= 1e-4
    assert released_tags(server.url) == set()
    assert _index(requests_log, "resume_memory_occupation", ["kv_cache"]) < _index(requests_log, "generate")


def test_offload_train_probe_offloads_resumes_the_kv_cache_and_releases_it_again(
    server, saved, requests_log, scored_by_transformers
):
    offloader = RecordingOffloader(requests_log)  # (with offload_train the KV cache comes back after the offload)
    session = session_for(server, saved, offloader=offloader)
    assert not session.colocation.kv_cache_after_sync
    session.colocation.release_engines()
    metrics = session.sync()
    assert metrics["sync/verify_max_abs_diff"] <= 1e-4
    order = [
        _index(requests_log, "resume_memory_occupation", ["weights"]),
        _index(requests_log, "update_weights_from_tensor"),
        _index(requests_log, "offload"),
        _index(requests_log, "resume_memory_occupation", ["kv_cache"]),
        _index(requests_log, "generate"),
        _index(requests_log, "release_memory_occupation", ["kv_cache"]),
        _index(requests_log, "reload"),
    ]
    assert order == sorted(order), requests_log
    # as the loop expects after a sync with offload_train: weights in, KV cache out, training state back
    assert released_tags(server.url) == {"kv_cache"} and not offloader.offloaded
    session.colocation.before_rollout()  # the next step: its offload, then the KV cache back
    assert offloader.offloaded
    assert released_tags(server.url) == set()


def test_version_only_syncs_and_the_probe_schedule(server, saved, requests_log, scored_by_transformers):
    session = session_for(server, saved, verify_every=3)
    probed = []
    for _ in range(5):
        session.colocation.release_engines()
        probed.append("sync/verify_max_abs_diff" in session.sync())
    assert probed == [True, False, False, True, False]  # the first sync, then every 3rd
    assert sum(1 for r, _ in requests_log if r == "model_info") >= 5  # the version check every sync


def test_a_stale_engine_is_a_clear_error(server, saved, scored_by_transformers):
    session = session_for(server, saved, verify_every=0)  # version check only
    stale = session.syncer.sync

    def push_without_version_bump():
        out = stale()
        SGLangHttpClient(server.url).post("update_weight_version", {"new_version": "old"})
        return out

    session.syncer.sync = push_without_version_bump
    with pytest.raises(
        RuntimeError,
        match=r"weight sync check failed: engine 0 reports weight version 'old' after "
        r"sync '\d+'",
    ):
        session.sync()


def _sampled(url: str) -> list[list[int]]:
    sp = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    out = SGLangHttpClient(url, timeout_s=120).generate(PROMPTS * 2, [sp] * 4)
    return [o["output_ids"] for o in out]


def test_release_and_resume_do_not_reseed_sampling(model_dir, saved, tmp_path):
    args = ("--enable-memory-saver", "--random-seed", "11")
    first = CpuServer(model_dir, str(tmp_path), tp=1, extra=args)
    try:
        engine = SGLangRolloutEngine([first.client])
        a = _sampled(first.url)
        engine.release_memory()
        engine.resume_memory()
        PushSyncer(engine, saved).sync()  # (resumed weights are zeros: push them)
        b = _sampled(first.url)
        PushSyncer(engine, saved).sync()
        c = _sampled(first.url)
    finally:
        first.stop()
    assert b != a and c != b and c != a  # one stream through release / resume and updates
    fresh = CpuServer(model_dir, str(tmp_path), tp=1, extra=args)
    try:
        assert _sampled(fresh.url) == a  # the same seed still reproduces a run
    finally:
        fresh.stop()
