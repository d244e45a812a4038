"""Tiny random Hugging Face models built with transformers' own classes (tests and the CPU demo).

``save_tiny_hf_model(kind, out_dir, seed=0, **overrides)`` builds the family ``kind``'s tiny config
(``ModelFamily.tiny``) and writes config.json + model.safetensors (+ generation_config.json) exactly
as ``save_pretrained`` does, so every conversion test starts from a checkpoint transformers itself
wrote. ``max_shard_size`` (e.g. "20KB") makes a sharded checkpoint with model.safetensors.index.json.
"""

from __future__ import annotations

import torch

from gspo_megatron.models.registry import families, family_for_model_type, get_family

TINY_CONFIGS: dict[str, dict] = {f.name: f.tiny for f in families() if f.tiny}


def hf_model_from_config(cfg: dict, dtype: torch.dtype = torch.float32):
    """A randomly initialized transformers model (its own config and model classes, found through
    ``model_type``, else the family of ``architectures``) for an HF config dict."""
    import transformers

    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    model_type = kwargs.pop("model_type", None) or get_family(cfg).name
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    archs = cfg.get("architectures") or list(get_family({"model_type": model_type}).architectures[:1])
    config.architectures = list(archs)
    model_cls = getattr(transformers, archs[0], None)
    if model_cls is None:
        raise ValueError(f"transformers {transformers.__version__} has no class {archs[0]!r}")
    return model_cls(config).to(dtype)


def save_tiny_hf_model(
    kind: str,
    out_dir: str,
    seed: int = 0,
    dtype=torch.float32,
    max_shard_size: str | int | None = None,
    with_mtp: bool = False,
    **overrides,
):
    """Build a tiny random ``kind`` model (a family name) and ``save_pretrained`` it. Router, gate
        norm weights and expert-score correction biases are randomized too, so routing, gates and norms are
    exercised. ``with_mtp``: one MTP layer declared (the family's ``mtp_naming.count_field``:
    ``num_nextn_predict_layers`` / ``mtp_num_hidden_layers``) and written next to the model
    (:func:`mtp_layer_tensors`; one unsharded file)."""
    family = next((f for f in families() if f.name == kind), None) or family_for_model_type(kind)
    if family is None or not family.tiny:
        raise ValueError(f"no tiny config for {kind!r}; known: {', '.join(TINY_CONFIGS)}")
    if with_mtp:
        overrides = {**overrides, family.mtp_naming.count_field: 1}
    cfg = dict(family.tiny, model_type=family.model_types[0])  # (qwen3_5_moe: the text model's qwen3_5_moe_text)
    cfg.update(overrides)
    cfg = family.tiny_hf_config(cfg)
    torch.manual_seed(seed)
    model = hf_model_from_config(cfg, dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".gate." in name or name.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: it changes the expert choice
                b.copy_(torch.randn_like(b) * 0.5)
        family.randomize_tiny(model)
    kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
    model.save_pretrained(out_dir, **kwargs)
    if with_mtp:
        import os

        from safetensors.torch import load_file, save_file

        path = os.path.join(out_dir, "model.safetensors")
        saved = load_file(path)
        save_file({**saved, **mtp_layer_tensors(saved, cfg, seed + 5)}, path, metadata={"format": "pt"})
    return model


def mtp_layer_tensors(saved: dict, hf: dict, seed: int = 5, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """The MTP layer of a tiny checkpoint whose tensors ``saved`` (as ``save_pretrained`` wrote them) has
    config ``hf``, in the published layout of its family (``models/mtp.MTPNaming``: ``model.layers.{N}.*``
    or ``mtp.*``): a copy of the last decoder layer with full attention perturbed (a MoE layer, as the
    published ones; Qwen3-Next's MTP layer is full attention wherever its hybrid stack ends), random ``enorm``, ``hnorm``, ``eh_proj`` and final
    norm, and where the layout has them the published copies of the embedding and head (DeepSeek's
    ``embed_tokens``, ``shared_head.head``: the target's own)."""
    from gspo_megatron.models.hf_config import lift_text_config
    from gspo_megatron.models.mtp import mtp_naming

    hf = lift_text_config(hf)  # a vision-language config: its language model's fields
    naming = mtp_naming(hf)
    n, h = int(hf["num_hidden_layers"]), int(hf["hidden_size"])
    g = torch.Generator().manual_seed(seed)
    layers = f"{(get_family(hf).language_model_prefix if 'text_config' in hf else None) or 'model.'}layers."
    # the last decoder layer with full attention (a hybrid stack may end with a Gated DeltaNet layer)
    last = next((i for i in range(n - 1, -1, -1) if any(k.startswith(f"{layers}{i}.self_attn.") for k in saved)), n - 1)
    src, dst = f"{layers}{last}.", naming.prefix(hf)
    out = {}
    for name in sorted(saved):
        if name.startswith(src):
            t = saved[name].float()
            out[dst + name[len(src) :]] = (t + scale * t.std() * torch.randn(t.shape, generator=g)).contiguous()
    own = naming.own(hf)
    out[own["enorm.weight"]] = 1 + 0.3 * torch.randn(h, generator=g)
    out[own["hnorm.weight"]] = 1 + 0.3 * torch.randn(h, generator=g)
    out[own["eh_proj.weight"]] = torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5
    out[own["final_layernorm.weight"]] = 1 + 0.3 * torch.randn(h, generator=g)
    embed = saved[layers.removesuffix("layers.") + "embed_tokens.weight"]
    sources = (embed, saved.get("lm_head.weight", embed))
    for name, t in zip(naming.shared_names(hf), sources):
        out[name] = t.clone()
    return out
