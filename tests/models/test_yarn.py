"""YaRN RoPE on grouped-query attention (models/yarn.py). test_equivalence.py shows Megatron's
log-probs equal transformers' for qwen3_moe / qwen3 with YaRN (defaults; explicit attention factor
with truncate=false); here: that YaRN really changes transformers' output on those configs (so the
equality is not trivially met by plain RoPE), the field translation, and what is refused."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.models import get_family
from gspo_megatron.models.yarn import yarn_fields
from tiny_models import tiny_hf_config

ROWS = [list(range(3, 26))]


@torch.no_grad()
def _logprobs(model) -> torch.Tensor:
    t = torch.tensor(ROWS)
    return torch.log_softmax(model(t).logits[0, :-1].float(), -1).gather(1, t[0, 1:, None]).squeeze(1)


@pytest.mark.parametrize(
    "kind,rope",
    [
        ("qwen3_moe", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8)),
        (
            "qwen3",
            dict(
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=8,
                attention_factor=1.3,
                beta_fast=16,
                truncate=False,
            ),
        ),
    ],
)
def test_yarn_changes_transformers_output(tmp_path, kind, rope):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    yarn = save_tiny_hf_model(kind, str(tmp_path / "y"), seed=11, rope_scaling=rope)
    plain = save_tiny_hf_model(kind, str(tmp_path / "p"), seed=11)
    plain.load_state_dict(yarn.state_dict())
    assert (_logprobs(yarn.eval()) - _logprobs(plain.eval())).abs().max() > 1e-3


def _hf(**rope) -> dict:
    return tiny_hf_config("qwen3", rope_scaling=dict(rope_type="yarn", **rope))


def test_field_translation():
    f = yarn_fields(_hf(factor=4.0, original_max_position_embeddings=128), "qwen3")
    assert f == dict(
        yarn_rotary_scaling_factor=4.0,
        yarn_original_max_position_embeddings=128,
        yarn_beta_fast=32.0,
        yarn_beta_slow=1.0,
        yarn_mscale=None,
        yarn_mscale_all_dim=None,
        yarn_correction_range_round_to_int=True,
    )
    # factor absent: max_position_embeddings / original (512 / 128)
    assert yarn_fields(_hf(original_max_position_embeddings=128), "qwen3")["yarn_rotary_scaling_factor"] == 4.0
    # an explicit attention factor a: Megatron's ratio get_mscale(f, m) / get_mscale(f, 0) equals a
    f = yarn_fields(_hf(factor=8.0, original_max_position_embeddings=64, attention_factor=1.3), "qwen3")
    assert f["yarn_mscale_all_dim"] == 0.0
    assert math.isclose(0.1 * f["yarn_mscale"] * math.log(8.0) + 1.0, 1.3, rel_tol=1e-12)
    both = yarn_fields(_hf(factor=8.0, original_max_position_embeddings=64, mscale=0.7, mscale_all_dim=0.7), "qwen3")
    assert (both["yarn_mscale"], both["yarn_mscale_all_dim"]) == (0.7, 0.7)
    fam = get_family({"model_type": "qwen3"})
    assert fam.rotary_kwargs(_hf(factor=4.0, original_max_position_embeddings=128))["position_embedding_type"] == "yarn"
    assert fam.rotary_kwargs(tiny_hf_config("qwen3"))["position_embedding_type"] == "rope"


@pytest.mark.parametrize(
    "kind,extra,field",
    [
        (
            "glm4_moe",
            dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)),
            "partial_rotary_factor",
        ),
        (
            "qwen3",
            dict(
                rope_scaling=dict(
                    rope_type="yarn", factor=1.0, original_max_position_embeddings=128, attention_factor=1.2
                )
            ),
            "attention_factor",
        ),
        ("qwen3_moe", dict(rope_scaling=dict(rope_type="llama3", factor=8.0)), "rope type 'llama3'"),
    ],
)
def test_refused_with_one_line(kind, extra, field):
    fam = get_family({"model_type": kind})
    with pytest.raises(ValueError) as e:
        fam.config_fields(tiny_hf_config(kind, **extra))
    assert field in str(e.value) and "\n" not in str(e.value)
