"""The one layout check (gspo_megatron/parallel_layout.py): the trainer's config checks, the tools, the
model builder and the process-group set-up all report the same problems, each naming its field."""

import pytest

from gspo_megatron.config import load_config, validate, validate_model_layout
from gspo_megatron.convert import UsageError, check_world_layout
from gspo_megatron.errors import ConfigError
from gspo_megatron.models.arch import KNOWN_ARCHS
from gspo_megatron.models.build import check_layout
from gspo_megatron.parallel_layout import layout_errors
from gspo_megatron.runtime.distributed import ParallelLayout

QWEN = KNOWN_ARCHS["qwen3-30b-a3b"]  # 32 heads, 4 kv heads, 128 experts, 48 layers, moe ffn 768
DSV3 = KNOWN_ARCHS["deepseek-v3"]  # 128 heads, kv_lora_rank 512 + qk_rope 64, q_lora_rank 1536, 1 shared expert


def test_a_good_layout_has_no_errors():
    assert layout_errors(4, 2, 8, 1, 1, world_size=64, hf=QWEN, sequence_parallel=True) == []
    assert layout_errors(8, 1, 32, 1, 1, world_size=256, hf=DSV3, sequence_parallel=True) == []


def test_every_caller_reports_the_same_problem_naming_its_field(monkeypatch):
    expected = "tp=3 must divide num_attention_heads = 32"
    assert f"parallel.{expected}" in layout_errors(3, hf=QWEN)
    with pytest.raises(ConfigError, match=f"parallel.{expected}"):
        validate_model_layout(load_config(None, ["parallel.tp=3", "parallel.etp=1"], check_files=False), QWEN)
    with pytest.raises(ValueError, match=f"parallel.{expected}"):
        check_layout(QWEN, 3, 1, 1, 1)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageError, match=f"--{expected}"):
        check_world_layout(QWEN, 3, 1, 1, 1)


def test_world_size_rules_are_shared_by_config_and_process_groups():
    msg = "parallel.tp * parallel.pp * parallel.cp = 2 * 2 * 1 = 4 must divide the world size 6"
    with pytest.raises(ValueError, match=msg.replace("*", r"\*")):
        ParallelLayout(tp=2, pp=2).check(6)
    with pytest.raises(ConfigError, match=msg.replace("*", r"\*")):
        validate(load_config(None, ["parallel.tp=2", "parallel.pp=2"], check_files=False), 6)
    assert layout_errors(1, 1, 4, 1, 1, world_size=2) == [
        "parallel.ep * parallel.etp * parallel.pp = 4 * 1 * 1 = 4 must divide the world size 2"
    ]


@pytest.mark.parametrize(
    "args, hf, expected",
    [
        # the family's further TP-split dims (MLA's low-rank projections) and the shared expert, which the
        # model builder always refused and the config checks now refuse before any rank starts
        (dict(tp=8), {**DSV3, "kv_lora_rank": 513}, "parallel.tp=8 must divide kv_lora_rank + qk_rope_head_dim = 577"),
        (dict(tp=8), {**DSV3, "q_lora_rank": 1540}, "parallel.tp=8 must divide q_lora_rank = 1540"),
        (
            dict(tp=2),
            {
                **QWEN,
                "shared_expert_intermediate_size": 1025,
                "model_type": "qwen2_moe",
                "architectures": ["Qwen2MoeForCausalLM"],
            },
            "parallel.tp=2 must divide the shared expert intermediate size = 1025",
        ),
        (
            dict(tp=1, ep=2),
            {**QWEN, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "intermediate_size": 6144},
            "parallel.ep=2 needs an MoE model; qwen3 has no experts",
        ),
        (dict(tp=0), QWEN, "parallel.tp must be >= 1, got 0"),
    ],
)
def test_model_rules(args, hf, expected):
    assert expected in layout_errors(**args, hf=hf), layout_errors(**args, hf=hf)
