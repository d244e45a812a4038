"""Planner: the DSA indexer selection's memory under ``rollout.routing_replay=r3`` (DeepSeek-V3.2, GLM-5):
(tokens - 1) x layers x index_topk x 4 bytes per sample (int32, sglang's ``meta_info["indexer_topk"]``),
the step's DP share on each training GPU next to the routes' row, every rank's host memory in a note;
nothing with replay off or r2, nothing for a model without an indexer."""

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.features.routing_replay import indexer_bytes_per_sample
from gspo_megatron.models.arch import KNOWN_ARCHS
from gspo_megatron.planner import GIB, ModelDims, make_plan

BASE = [
    "rollout.prompts_per_step=16",
    "rollout.group_size=4",
    "gspo.mini_batches=2",
    "parallel.micro_batch_size=1",
    "model.dtype=bfloat16",
    "rollout.engine=sglang",
    "rollout.sync_mode=colocated",
    "model.max_seq_len=4096",
]
DSA = ["model.arch=deepseek-v3.2", "parallel.ep=8"]


def _row(plan, what, stage=0):
    found = [b for label, b in plan.stages[stage].train_items if label.startswith(what)]
    assert len(found) <= 1, plan.stages[stage].train_items
    return found[0] if found else None


def test_indexer_bytes_closed_form():
    d = ModelDims.from_hf_config(KNOWN_ARCHS["deepseek-v3.2"])
    assert d.index_topk == 2048
    assert indexer_bytes_per_sample(d, 100) == 99 * d.num_layers * 2048 * 4
    assert indexer_bytes_per_sample(d, 0) == 0
    assert indexer_bytes_per_sample(ModelDims.from_hf_config(KNOWN_ARCHS["tiny-qwen3-moe"]), 100) == 0


def test_r3_counts_the_indexer_selection_on_dsa_models():
    d = ModelDims.from_hf_config(KNOWN_ARCHS["deepseek-v3.2"])
    cfg = load_config(None, BASE + DSA + ["rollout.routing_replay=r3"], check_files=False)
    plan = make_plan(cfg, 4, 8, 140.0)
    per_rank = cfg.step_batch_size / plan.dp
    want = per_rank * (cfg.model.max_seq_len - 1) * d.num_layers * d.index_topk * 4
    for stage in range(len(plan.stages)):
        assert _row(plan, "routing replay r3: engine routes", stage) is not None
        assert _row(plan, "routing replay r3: engine indexer selection", stage) == pytest.approx(want)
    host = cfg.step_batch_size * (cfg.model.max_seq_len - 1) * d.num_layers * d.index_topk * 4
    assert any("indexer selection" in n and f"{host / GIB:.2f} GiB" in n for n in plan.notes), plan.notes
    for other in ("off", "r2"):
        plan = make_plan(
            load_config(None, BASE + DSA + [f"rollout.routing_replay={other}"], check_files=False), 4, 8, 140.0
        )
        assert _row(plan, "routing replay r3: engine indexer selection") is None
        assert not any("indexer selection" in n for n in plan.notes), plan.notes


def test_no_indexer_row_without_an_indexer():
    cfg = load_config(None, BASE[:-1] + ["rollout.routing_replay=r3"])
    plan = make_plan(cfg, 1, 8, 80.0)
    assert _row(plan, "routing replay r3: engine routes") is not None
    assert _row(plan, "routing replay r3: engine indexer selection") is None
