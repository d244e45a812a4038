"""Planner: the routes' memory under ``rollout.routing_replay`` (issue 24): (tokens - 1) x layers x
top-k x 4 bytes per sample (int32 routes), the step's DP share on each training GPU; r2's record of a
stage's layers (int64); nothing with replay off."""

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.features.routing_replay import route_bytes_per_sample
from gspo_megatron.models.arch import KNOWN_ARCHS
from gspo_megatron.planner import GIB, ModelDims, make_plan

TINY = KNOWN_ARCHS["tiny-qwen3-moe"]
BASE = [
    "rollout.prompts_per_step=16",
    "rollout.group_size=4",
    "gspo.mini_batches=2",
    "parallel.micro_batch_size=1",
    "model.dtype=bfloat16",
    "rollout.engine=sglang",
    "rollout.sync_mode=colocated",
]


def _route_row(plan, stage=0):
    found = [b for label, b in plan.stages[stage].train_items if label.startswith("routing replay")]
    return found[0] if found else None


def test_r3_routes_per_sample_closed_form():
    d = ModelDims.from_hf_config(TINY)
    assert route_bytes_per_sample(d, 100) == 99 * d.num_layers * d.topk * 4
    assert route_bytes_per_sample(d, 0) == 0
    off = make_plan(load_config(None, BASE), 1, 8, 80.0)
    assert _route_row(off) is None
    cfg = load_config(None, BASE + ["rollout.routing_replay=r3"])
    plan = make_plan(cfg, 1, 8, 80.0)
    per_rank = cfg.step_batch_size / plan.dp
    assert _route_row(plan) == pytest.approx(per_rank * (cfg.model.max_seq_len - 1) * d.num_layers * d.topk * 4)
    host = cfg.step_batch_size * (cfg.model.max_seq_len - 1) * d.num_layers * d.topk * 4
    assert any(f"{host / GIB:.2f} GiB" in n for n in plan.notes), plan.notes
    assert plan.stages[0].train_peak == pytest.approx(off.stages[0].train_peak + _route_row(plan))


def test_r2_record_of_this_stages_layers():
    d = ModelDims.from_hf_config(TINY)
    cfg = load_config(None, BASE + ["rollout.routing_replay=r2", "parallel.pp=2"])
    plan = make_plan(cfg, 1, 8, 80.0)
    per_rank = cfg.step_batch_size / plan.dp
    want = per_rank * cfg.model.max_seq_len * (d.num_layers // 2) * d.topk * 8
    assert _route_row(plan, 0) == pytest.approx(want) and _route_row(plan, 1) == pytest.approx(want)
