"""Tiny checkpoints with one MTP layer in the published layout, for the draft's tests.

``mtp_tensors(model, hf, seed)``: the MTP layer ``model.layers.{N}.*`` (N = num_hidden_layers) of a tiny
transformers model in the checkpoint layout: a copy of layer N-1 perturbed (so MoE for GLM-4.5 /
DeepSeek-V3), ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` random, plus the published
copies of the embedding and head (``embed_tokens``, ``shared_head.head``: the target's own, as the
published checkpoints store them). ``write_mtp_checkpoint(dir, family, seed)``: the tiny checkpoint with
``num_nextn_predict_layers: 1`` and that layer added to its model.safetensors.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file


def mtp_tensors(model, hf: dict, seed: int = 5, scale: float = 0.3) -> dict[str, torch.Tensor]:
    from gspo_megatron.engines.hf_engine import HFCheckpointLayout

    n, h = hf["num_hidden_layers"], hf["hidden_size"]
    layout = HFCheckpointLayout(model)
    g = torch.Generator().manual_seed(seed)
    src, dst = f"model.layers.{n - 1}.", f"model.layers.{n}."
    out = {}
    for name in layout.checkpoint_names():
        if name.startswith(src):
            t = layout.target(name).detach()
            out[dst + name[len(src) :]] = (t + scale * t.std() * torch.randn(t.shape, generator=g)).contiguous()
    out[dst + "enorm.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    out[dst + "hnorm.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    out[dst + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5
    out[dst + "shared_head.norm.weight"] = 1 + 0.3 * torch.randn(h, generator=g)
    out[dst + "embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    out[dst + "shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    return out


def write_mtp_checkpoint(path: str, family: str, seed: int = 0, **overrides):
    """The tiny ``family`` checkpoint in ``path`` with one MTP layer; returns (its config dict, the
    transformers model, the MTP tensors)."""
    from gspo_megatron.models.tiny import save_tiny_hf_model

    model = save_tiny_hf_model(family, path, seed=seed, num_nextn_predict_layers=1, **overrides)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    mtp = mtp_tensors(model, hf, seed=seed + 5)
    t = load_file(os.path.join(path, "model.safetensors"))
    save_file({**t, **mtp}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return hf, model, mtp
