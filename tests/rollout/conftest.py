"""Fixtures shared by the CPU-server tests: the demo's tiny Qwen3-MoE checkpoint and its tensors."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def model_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_moe", subdir="")[0]


@pytest.fixture(scope="module")
def saved(model_dir):
    return load_file(os.path.join(model_dir, "model.safetensors"))
