"""Planner under ``rollout.lora_sync=adapter`` on colocated engines (weight_sync/lora_adapter.py): the
engines keep their weights while the trainer trains (a released base would not be sent again), so the
training phase carries the engine's bf16 weights / engine_tp; the rollout phase carries sglang's LoRA
memory pool (2 adapters at max rank, bf16) out of the KV cache. Merged sync: neither row."""

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.models.arch import KNOWN_ARCHS
from gspo_megatron.planner import ModelDims, lora_layer_params, make_plan, param_counts

TINY = KNOWN_ARCHS["tiny-qwen3-moe"]
BASE = [
    "rollout.prompts_per_step=16",
    "rollout.group_size=4",
    "gspo.mini_batches=2",
    "parallel.micro_batch_size=1",
    "model.dtype=bfloat16",
    "rollout.engine=sglang",
    "rollout.sync_mode=colocated",
    "rollout.engine_tp=2",
    "model.lora.rank=8",
    "model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
]


def _row(items, prefix):
    found = [b for label, b in items if label.startswith(prefix)]
    return found[0] if found else None


def test_adapter_sync_keeps_engine_weights_and_counts_the_lora_pool():
    merged = make_plan(load_config(None, [*BASE, "rollout.lora_sync=merged"]), 1, 8, 80.0)
    adapter = make_plan(load_config(None, [*BASE, "rollout.lora_sync=adapter"]), 1, 8, 80.0)
    d = ModelDims.from_hf_config(TINY)
    weights = param_counts(d).total * 2 / 2  # bf16 / engine_tp 2
    pool = 2 * 2 * sum(sum(lora_layer_params(d, i, 8)) for i in range(d.num_layers))
    m, a = merged.stages[0], adapter.stages[0]
    assert _row(m.train_items, "engine weights kept") is None and _row(m.rollout_items, "engine LoRA pool") is None
    assert _row(a.train_items, "engine weights kept") == pytest.approx(weights)
    assert a.train_peak == pytest.approx(m.train_peak + weights)
    assert _row(a.rollout_items, "engine LoRA pool") == pytest.approx(pool) and pool > 0
    assert a.kv_cache == pytest.approx(m.kv_cache - pool)
