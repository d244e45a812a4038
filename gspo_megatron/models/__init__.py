"""Models: the HF <-> Megatron-Core machinery and one folder per architecture family.

Importing this package registers every family (their folders use ``@register_family`` from
``registry.py``, which imports none of them). To add a family: docs/adding_a_model.md.

The package's public surface is the family lookup (docs/adding_a_model.md): ``get_family(config_dict)``
and ``families()``, defined in ``registry.py``; everything else is imported from its own module.
"""

from gspo_megatron.models.registry import families, get_family

__all__ = ["families", "get_family"]

# Registration (import order = listing order in messages and the planner's built-in table).
# isort: off
from gspo_megatron.models import qwen3_moe  # noqa: F401
from gspo_megatron.models import qwen2_moe  # noqa: F401
from gspo_megatron.models import deepseek_v3  # noqa: F401
from gspo_megatron.models import deepseek_v32  # noqa: F401
from gspo_megatron.models import glm_moe_dsa  # noqa: F401
from gspo_megatron.models import glm4_moe  # noqa: F401
from gspo_megatron.models import gpt_oss  # noqa: F401
from gspo_megatron.models import mixtral  # noqa: F401
from gspo_megatron.models import qwen3  # noqa: F401
from gspo_megatron.models import qwen2  # noqa: F401
from gspo_megatron.models import minimax_m2  # noqa: F401
from gspo_megatron.models import qwen3_next  # noqa: F401
from gspo_megatron.models import qwen3_5_moe  # noqa: F401
# isort: on
