"""Planner: the capture buffers ``rollout.routing_replay=r3`` makes every sglang 0.5.23 engine process
allocate (``planner.capture_buffer_bytes``; ``state_capturer/base.py``, ``routed_experts.py``,
``indexer_topk.py``): host pinned int32 [KV tokens + page_size, layers, topk (+ index_topk on DSA)], GPU
int32 [max(chunked_prefill_size, max_running_requests), layers, topk (+ index_topk)], checked against
a hand computation."""

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.features.routing_replay import capture_buffer_bytes
from gspo_megatron.models.arch import KNOWN_ARCHS
from gspo_megatron.plan_report import format_plan
from gspo_megatron.planner import GIB, ModelDims, make_plan
from test_planner_indexer import BASE, DSA  # the colocated sglang DeepSeek-V3.2 plan those tests use

ROW = "routing replay r3: sglang capture buffers"


def _cfg(*overrides):
    return load_config(None, [*BASE, *overrides], check_files=False)


def test_dsa_buffers_by_hand():
    d = ModelDims.from_hf_config(KNOWN_ARCHS["deepseek-v3.2"])
    cfg = _cfg(*DSA, "rollout.routing_replay=r3")
    # 500k KV tokens on an 80 GiB GPU: chunked_prefill_size 8192 (memory_hook.py: 60..90 GiB);
    # max_running_requests = min(max(min(500000 / 163840 * 512 = 1562, 4096), 2048), 250000) = 2048
    host, gpu = capture_buffer_bytes(d, cfg, 500_000, 80 * GIB)
    width = 61 * (8 + 2048)  # layers x (routes' top-8 + the indexer's top-2048)
    assert host == (500_000 + 64) * width * 4  # 233.6 GiB per engine process
    assert gpu == 8192 * width * 4  # 3.83 GiB per engine GPU
    assert host / GIB == pytest.approx(233.635, abs=1e-3) and gpu / GIB == pytest.approx(3.827, abs=1e-3)
    # a bigger GPU: chunked_prefill_size 16384 (>= 160 GiB)
    assert capture_buffer_bytes(d, cfg, 500_000, 192 * GIB)[1] == 16384 * width * 4
    # max_running_requests above chunked_prefill_size: 4096 (the cap) on a 20..60 GiB GPU
    assert capture_buffer_bytes(d, cfg, 2_000_000, 40 * GIB)[1] == 4096 * width * 4


def test_routes_only_without_an_indexer_and_nothing_without_r3():
    d = ModelDims.from_hf_config(KNOWN_ARCHS["tiny-qwen3-moe"])  # 2 layers, top-2, context 512
    cfg = _cfg("rollout.routing_replay=r3")
    # 10000 tokens: max_running = min(max(min(10000 / 512 * 512, 4096), 2048), 5000) = 4096 < 8192
    assert capture_buffer_bytes(d, cfg, 10_000, 80 * GIB) == ((10_000 + 1) * 2 * 2 * 4, 8192 * 2 * 2 * 4)
    for other in ("off", "r2"):
        assert capture_buffer_bytes(d, _cfg(f"rollout.routing_replay={other}"), 10_000, 80 * GIB) == (0.0, 0.0)


def test_the_plan_counts_them_on_every_engine_gpu():
    d = ModelDims.from_hf_config(KNOWN_ARCHS["deepseek-v3.2"])
    cfg = _cfg(*DSA, "rollout.routing_replay=r3")
    plan = make_plan(cfg, 4, 8, 140.0)
    for s in plan.stages:
        tokens = s.kv_cache / plan.kv_per_token
        host, gpu = capture_buffer_bytes(d, cfg, tokens, 140 * GIB)
        assert host > 0 and s.host_capture == host
        assert dict(s.rollout_items)[next(k for k, _ in s.rollout_items if k.startswith(ROW))] == gpu
    assert "capture buffers" in format_plan(plan)
    # a model whose engines fit: the KV cache fills engine_mem_fraction, the GPU buffers come on top
    # (allocated after the KV pool, outside mem_fraction_static)
    small = load_config(None, [*BASE[:-1], "rollout.routing_replay=r3", "rollout.offload_train=true"])
    plan = make_plan(small, 1, 8, 80.0)
    (s,) = plan.stages
    assert s.kv_cache > 0
    host, gpu = capture_buffer_bytes(plan.dims, small, s.kv_cache / plan.kv_per_token, 80 * GIB)
    assert s.host_capture == host and gpu > 0
    assert s.rollout_peak == pytest.approx(small.rollout.engine_mem_fraction * 80 * GIB + gpu)
    off = make_plan(_cfg(*DSA), 4, 8, 140.0)
    assert all(s.host_capture == 0 and not any(k.startswith(ROW) for k, _ in s.rollout_items) for s in off.stages)


def test_owner_direct_counts_the_foreign_cuda_contexts_in_both_phases():
    """``rollout.sync_owner_direct``: up to one CUDA context per other GPU of the node on every GPU
    (engine processes opening this GPU's holder buffers), in the rollout and the training phase."""
    from gspo_megatron.features.owner_direct import FOREIGN_CONTEXT_GIB

    base = [
        "model.arch=tiny-qwen3-moe",
        "model.max_seq_len=256",
        "parallel.ep=2",
        "rollout.engine_ep=2",
        "rollout.engine_tp=2",
    ]
    without = make_plan(_cfg(*base), 1, 8, 80.0).stages[0]
    plan = make_plan(_cfg(*base, "rollout.sync_owner_direct=true"), 1, 8, 80.0)
    s = plan.stages[0]
    rows = [b for n, b in s.rollout_items if n.startswith("owner-direct sync: 7 foreign CUDA contexts")]
    assert rows == [7 * FOREIGN_CONTEXT_GIB * GIB]
    assert s.rollout_peak - without.rollout_peak == pytest.approx(rows[0])
    assert s.train_peak - without.train_peak == pytest.approx(rows[0])
    assert "owner-direct sync: 7 foreign CUDA contexts (0.5 GiB each)" in format_plan(plan)
    one_gpu = make_plan(_cfg(*base[:2], "rollout.sync_owner_direct=true"), 1, 1, 80.0).stages[0]
    assert not [n for n, _ in one_gpu.rollout_items if n.startswith("owner-direct")]
