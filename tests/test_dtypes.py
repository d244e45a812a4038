"""The one dtype table (gspo_megatron/dtypes.py): every spelling the project reads maps to one torch
dtype and back to the canonical name; the config's and the tools' dtype choices are that table."""

import typing

import pytest
import torch

from gspo_megatron.config import ModelConfig
from gspo_megatron.dtypes import DTYPE_BYTES, DTYPE_NAMES, canonical_name, dtype_name, torch_dtype


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("torch.bfloat16", torch.bfloat16),
        ("half", torch.float16),
        ("float", torch.float32),
        ("float8_e4m3fn", torch.float8_e4m3fn),
        ("int64", torch.int64),
    ],
)
def test_names_to_torch_and_back(name, dtype):
    assert torch_dtype(name) is dtype
    assert dtype_name(dtype) == canonical_name(name)
    assert torch_dtype(dtype_name(dtype)) is dtype


def test_sizes_match_torch_and_the_config_choices():
    for name, size in DTYPE_BYTES.items():
        assert torch_dtype(name).itemsize == size
    assert DTYPE_NAMES == typing.get_args(typing.get_type_hints(ModelConfig)["dtype"])


@pytest.mark.parametrize("bad", ["float33", "Tensor", "auto"])
def test_not_a_dtype(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        torch_dtype(bad)
