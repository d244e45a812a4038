"""Models: the HF <-> Megatron-Core machinery and one folder per architecture family.

Importing this package registers every family (their folders use ``@register_family`` from
``registry.py``, which imports none of them). To add a family: docs/adding_a_model.md.
"""

from gspo_megatron.models.hf_config import load_hf_config  # noqa: F401
from gspo_megatron.models.registry import families, get_family, register_family, supported_model_types  # noqa: F401

# Registration (import order = listing order in messages and the planner's built-in table).
from gspo_megatron.models import qwen3_moe, qwen2_moe, deepseek_v3, deepseek_v32, glm_moe_dsa, glm4_moe, gpt_oss, mixtral, qwen3, qwen2, minimax_m2, qwen3_next, qwen3_5_moe  # noqa: F401,E402,E501  isort: skip
