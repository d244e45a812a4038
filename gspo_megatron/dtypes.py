"""The one dtype table: names (as in the config, config.json, checkpoints' metadata and SGLang's weight
calls) <-> torch dtypes, and their sizes.

``DTYPE_BYTES`` / ``DTYPE_NAMES`` list the training dtypes (``model.dtype``, the conversion tools'
``--dtype``); :func:`torch_dtype` and :func:`dtype_name` convert any torch dtype (weight streams also
carry e.g. ``float8_e4m3fn``). Importing this module does not import torch (the planner stays light).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: training dtypes -> bytes per element
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_BYTES)
#: other spellings accepted on input (SGLang's --dtype; HF's "torch.bfloat16")
_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def canonical_name(name: str) -> str:
    """``"torch.bfloat16"`` / ``"half"`` / ``"bfloat16"`` -> ``"bfloat16"`` / ``"float16"`` / ``"bfloat16"``."""
    name = str(name).removeprefix("torch.")
    return _ALIASES.get(name, name)


def torch_dtype(name: str) -> "torch.dtype":
    """The torch dtype named ``name`` (any spelling :func:`canonical_name` accepts); ValueError if none."""
    import torch

    dtype = getattr(torch, canonical_name(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def dtype_name(dtype: "torch.dtype") -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form the config, checkpoints and SGLang use)."""
    return str(dtype).removeprefix("torch.")
