"""Tiny checkpoints with one MTP layer in the published layout, for the draft's tests
(``models.tiny.save_tiny_hf_model(with_mtp=True)``, the layer from ``models.tiny.mtp_layer_tensors``).

``write_mtp_checkpoint(dir, family, seed)``: the tiny checkpoint with one MTP layer declared and written in
its model.safetensors (``model.layers.{N}.*`` / Qwen3-Next's ``mtp.*``); returns (its config dict, the transformers model, the MTP tensors).
``mtp_tensors(model, hf, seed)``: the MTP layer for an in-memory tiny model (saved to a scratch directory).
"""

from __future__ import annotations

import json
import os
import tempfile

from safetensors.torch import load_file


def write_mtp_checkpoint(path: str, family: str, seed: int = 0, **overrides):
    """The tiny ``family`` checkpoint in ``path`` with one MTP layer; returns (its config dict, the
    transformers model, the MTP tensors)."""
    from gspo_megatron.models.tiny import save_tiny_hf_model

    model = save_tiny_hf_model(family, path, seed=seed, with_mtp=True, **overrides)
    from gspo_megatron.models.carried import mtp_names
    from gspo_megatron.models.hf_config import lift_text_config

    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    saved = load_file(os.path.join(path, "model.safetensors"))
    return hf, model, {k: saved[k] for k in mtp_names(lift_text_config(hf), saved)}


def mtp_tensors(model, hf: dict, seed: int = 5) -> dict:
    """The MTP layer (``models.tiny.mtp_layer_tensors``) of the in-memory tiny ``model`` with config ``hf``."""
    from gspo_megatron.models.tiny import mtp_layer_tensors

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        saved = load_file(os.path.join(d, "model.safetensors"))
    return mtp_layer_tensors(saved, hf, seed)
