"""``rollout.lora_sync=adapter`` (weight_sync/lora_adapter.py): the supported combination loads; every
unsupported one is refused in one line naming its fields; the engines' LoRA server args."""

from __future__ import annotations

import pytest

from gspo_megatron.config import load_config
from gspo_megatron.errors import ConfigError
from gspo_megatron.features.adapter_sync import engine_lora_args
from gspo_megatron.weight_sync.lora_adapter import fuse_shared_a

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


@pytest.mark.parametrize(
    "targets, fix",
    [
        (
            "linear_qkv,experts.linear_fc1",
            "model.lora.target_modules=[linear_qkv,experts.linear_fc1,experts.linear_fc2]",
        ),
        ("mlp.experts.linear_fc2", "model.lora.target_modules=[mlp.experts.linear_fc2,experts.linear_fc1]"),
        ("experts.linear_fc1,shared_experts.linear_fc1", "experts.linear_fc2]"),
    ],
)
def test_routed_experts_on_one_of_fc1_fc2_refused(targets, fix):
    """sglang 0.5.23 wraps an MoE layer with LoRA only when both gate_up_proj and down_proj are targets
    (lora_manager.py init_lora_modules): routed-expert adapters on one of linear_fc1 / linear_fc2 only
    would be dropped by the engine while the trainer trains them; refused in one line naming the field
    and a value that works."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [*OK, f"model.lora.target_modules=[{targets}]"])
    msg = str(e.value)
    assert "model.lora.target_modules=" in msg and "gate_up_proj and down_proj" in msg and fix in msg, msg
    assert "\n" not in msg.split("rollout.lora_sync=adapter: ", 1)[1], msg  # one line


@pytest.mark.parametrize(
    "targets",
    [
        "linear_qkv,experts.linear_fc1,experts.linear_fc2",
        "experts.linear_fc1,linear_fc2",  # the engine's targets hold down_proj: the MoE layer is wrapped
        "linear_qkv,shared_experts.linear_fc1",  # no routed experts named
    ],
)
def test_routed_experts_with_both_targets_load(targets):
    load_config(None, [*OK, f"model.lora.target_modules=[{targets}]"])


def test_bare_linear_fc1_refused_on_an_moe_model_only():
    """``linear_fc1`` alone reaches the routed experts of an MoE model (dense MLPs of a dense one): the
    model-layout check, which knows the model, refuses it for an MoE model only."""
    from gspo_megatron.config import validate_model_layout
    from gspo_megatron.features.adapter_sync import moe_lora_refusal
    from gspo_megatron.models.arch import KNOWN_ARCHS

    cfg = load_config(None, [*OK, "model.lora.target_modules=[linear_qkv,linear_fc1]"])  # statically fine
    with pytest.raises(ConfigError, match=r"target_modules=\[linear_qkv,linear_fc1,experts.linear_fc2\]"):
        validate_model_layout(cfg, KNOWN_ARCHS["tiny-qwen3-moe"])
    assert moe_lora_refusal(["linear_qkv", "linear_fc1"], moe=False) is None
    assert moe_lora_refusal(["linear_fc1", "linear_fc2"], moe=True) is None
    ok = load_config(None, OK)
    validate_model_layout(ok, KNOWN_ARCHS["tiny-qwen3-moe"])


def test_by_value_payload_decodes_with_sglangs_deserializer_bitwise():
    """The colocated payload (by_value_payload) carries the tensors' bytes, no shared-memory segment
    or IPC handle, and sglang's own MultiprocessingSerializer.deserialize (its SafeUnpickler) reads it."""
    import base64

    import torch

    from gspo_megatron.engines.sglang_compat import multiprocessing_serializer
    from gspo_megatron.weight_sync.lora_adapter import by_value_payload

    big = torch.randn(600, 8, dtype=torch.bfloat16)  # the view below is 2 of its 600 rows
    t = {"a.lora_A.weight": big[:2], "a.lora_B.weight": torch.randn(8, 2), "b": torch.arange(5)}
    payload = by_value_payload(t)
    raw = base64.b64decode(payload)
    assert b"rebuild_storage_filename" not in raw and b"rebuild_storage_fd" not in raw and b"torch_" not in raw
    got = multiprocessing_serializer().deserialize(payload)
    assert sorted(got) == sorted(t)
    for k, v in t.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        assert torch.equal(
            got[k].view(torch.uint8) if v.is_floating_point() else got[k],
            v.view(torch.uint8) if v.is_floating_point() else v,
        )
    assert len(raw) < 2 * sum(v.numel() * v.element_size() for v in t.values()) + 4096  # a view sends its own bytes


def test_lora_on_either_layer_spec_but_not_fp8():
    """LoRA loads with the local spec and with Transformer Engine's (models/lora_te.py); FP8 is refused
    in one line naming model.fp8."""
    for impl in ("local", "transformer_engine", "auto"):
        assert load_config(None, ["model.lora.rank=8", f"model.transformer_impl={impl}"]).model.lora.rank == 8
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.lora.rank=8", "model.transformer_impl=transformer_engine", "model.fp8=e4m3"])
    assert "model.fp8" in str(e.value) and "model.lora" in str(e.value)
