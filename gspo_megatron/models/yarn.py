"""YaRN RoPE for grouped-query attention (Qwen3 long-context checkpoints, gpt-oss).

Megatron-Core 0.16.1's GPTModel builds ``YarnRotaryEmbedding`` for ``position_embedding_type="yarn"``
from ``yarn_*`` attributes of its config, and the attention multiplies cos/sin by the same
concentration factor (transformers' ``attention_factor``) for q and k; the plain
``TransformerConfig`` has no such fields, so ``YarnTransformerConfig`` adds them (defaults: no
scaling, concentration 1).

transformers' ``_compute_yarn_parameters`` -> these fields:
- ``factor`` (default max_position_embeddings / original) -> ``yarn_rotary_scaling_factor``;
- ``beta_fast`` / ``beta_slow`` (default 32 / 1), ``original_max_position_embeddings``;
- ``truncate`` (default true: round the correction range to integers) ->
  ``yarn_correction_range_round_to_int``;
- the attention factor: explicit ``attention_factor`` a; else get_mscale(factor, mscale) /
  get_mscale(factor, mscale_all_dim) when both are set; else get_mscale(factor)
  (get_mscale(s, m) = 0.1 m ln s + 1 for s > 1, else 1). Megatron computes the same ratio from
  ``yarn_mscale`` / ``yarn_mscale_all_dim`` (None: get_mscale(factor)); an explicit a is expressed as
  mscale = (a - 1) / (0.1 ln factor), mscale_all_dim = 0.
Refused: partial rotary with YaRN (Megatron's YaRN embedding spans the whole head), an explicit
attention factor other than 1 with factor <= 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.core.transformer.transformer_config import TransformerConfig

from gspo_megatron.models import hf_config


@dataclass
class YarnTransformerConfig(TransformerConfig):
    """TransformerConfig with the ``yarn_*`` attributes Megatron-Core's GPTModel and attention read."""

    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = None
    yarn_mscale_all_dim: float | None = None
    yarn_correction_range_round_to_int: bool = True


def yarn_fields(hf: dict, family: str) -> dict:
    """``YarnTransformerConfig`` fields for an HF config whose rope type is yarn (ValueError naming
    the field for what Megatron cannot express)."""
    rope = hf_config.rope_parameters(hf)
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"config.json partial_rotary_factor with YaRN rope is not supported for {family}")
    max_pos = hf_config.get_int(hf, "max_position_embeddings")
    orig = int(rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or max_pos)
    factor = float(rope.get("factor") or max_pos / orig)
    a, m, m_all = rope.get("attention_factor"), rope.get("mscale"), rope.get("mscale_all_dim")
    if a is not None:
        if factor <= 1:
            if float(a) != 1.0:
                raise ValueError(
                    f"config.json rope attention_factor={a} with factor <= 1 is not supported for {family}"
                )
            m, m_all = None, None
        else:
            m, m_all = (float(a) - 1.0) / (0.1 * math.log(factor)), 0.0
    elif not (m and m_all):
        m, m_all = None, None
    return dict(
        yarn_rotary_scaling_factor=factor,
        yarn_original_max_position_embeddings=orig,
        yarn_beta_fast=float(rope.get("beta_fast") or 32),
        yarn_beta_slow=float(rope.get("beta_slow") or 1),
        yarn_mscale=None if m is None else float(m),
        yarn_mscale_all_dim=None if m_all is None else float(m_all),
        yarn_correction_range_round_to_int=bool(rope.get("truncate", True)),
    )
