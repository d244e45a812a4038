"""Fixtures shared by the CPU-server tests: the demo's tiny Qwen3-MoE checkpoint and its tensors."""

from __future__ import annotations

import os

import pytest
from safetensors.torch import load_file

from gspo_megatron.models.tiny import save_tiny_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_moe")
    save_tiny_hf_model("qwen3_moe", str(d))
    return str(d)


@pytest.fixture(scope="module")
def saved(model_dir):
    return load_file(os.path.join(model_dir, "model.safetensors"))
