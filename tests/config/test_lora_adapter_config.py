"""``rollout.lora_sync=adapter`` (weight_sync/lora_adapter.py): the supported combination loads; every
unsupported one is refused in one line naming its fields; the engines' LoRA server args."""

from __future__ import annotations

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.errors import ConfigError
from gspo_megatron.weight_sync.lora_adapter import engine_lora_args, fuse_shared_a

OK = [
    "model.lora.rank=8",
    "rollout.lora_sync=adapter",
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=colocated",
    "model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
]


def test_supported_combination_loads_and_engine_args():
    cfg = load_config(None, OK)
    assert engine_lora_args(cfg) == dict(
        enable_lora=True,
        max_lora_rank=8,
        max_loras_per_batch=2,
        max_loaded_loras=2,
        lora_target_modules=["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
    )


def test_parallel_layouts_and_routed_experts_load():
    """tp / pp / ep > 1 (the adapters are gathered per sync) and routed-expert targets (sglang's
    per-expert names) are supported: the engines' target modules cover the experts' gate/up/down."""
    load_config(
        None, [*OK, "rollout.sync_mode=disaggregated", "rollout.num_engines=1"]
    )  # PEFT dir + /load_lora_adapter
    cfg = load_config(
        None,
        [
            *OK,
            "parallel.tp=2",
            "parallel.ep=2",
            "model.lora.target_modules=[self_attention.linear_qkv,experts.linear_fc1,experts.linear_fc2]",
        ],
    )
    assert engine_lora_args(cfg)["lora_target_modules"] == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["model.lora.rank=0"], "rollout.lora_sync=adapter needs model.lora (model.lora.rank > 0)"),
        (["rollout.engine=hf", "rollout.sync_mode=inprocess"], "rollout.lora_sync=adapter needs rollout.engine=sglang"),
        (["rollout.sync_delta=true"], "rollout.lora_sync=adapter is not supported with rollout.sync_delta=true"),
        (["rollout.max_staleness=1"], "rollout.lora_sync=adapter is not supported with rollout.max_staleness=1"),
    ],
)
def test_unsupported_combinations_refused(extra, expected):
    with pytest.raises(ConfigError) as e:
        load_config(None, [*OK, *extra])
    assert expected in str(e.value), str(e.value)


def test_fuse_shared_a():
    import torch

    a, bq, bk, bv, ao, bo = (
        torch.randn(2, 4),
        torch.randn(4, 2),
        torch.randn(2, 2),
        torch.randn(2, 2),
        torch.randn(2, 4),
        torch.randn(4, 2),
    )
    p = "model.layers.0.self_attn."
    t = {
        f"base_model.model.{p}{m}.lora_{x}.weight": v
        for m, x, v in [
            ("q_proj", "A", a),
            ("k_proj", "A", a),
            ("v_proj", "A", a),
            ("q_proj", "B", bq),
            ("k_proj", "B", bk),
            ("v_proj", "B", bv),
            ("o_proj", "A", ao),
            ("o_proj", "B", bo),
        ]
    }
    out, mods = fuse_shared_a(t, [p + m for m in ("q_proj", "k_proj", "v_proj", "o_proj")])
    assert mods == [p + "o_proj", p + "qkv_proj"]
    assert torch.equal(out[f"base_model.model.{p}qkv_proj.lora_A.weight"], a)
    assert torch.equal(out[f"base_model.model.{p}qkv_proj.lora_B.weight"], torch.cat([bq, bk, bv]))
    assert sorted(out) == sorted(
        f"base_model.model.{p}{m}.lora_{x}.weight" for m in ("o_proj", "qkv_proj") for x in "AB"
    )
