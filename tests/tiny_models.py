"""The tests' one factory for tiny models (tests/conftest.py exposes the checkpoint writer as a fixture).

- ``tiny_hf_config(family, **overrides)``: a family's tiny HF config dict (``ModelFamily.tiny`` with its
  ``model_type``), the dict ``save_tiny_hf_model`` builds its model from (flat: before the family's
  ``ModelFamily.tiny_hf_config`` nests a vision-language model's text fields); a test that needs another
  dimension passes it as an override, so each test keeps its own numbers.
- ``write_tiny_hf_checkpoint(root, family, seed=0, subdir="hf", **overrides)``: that model saved by
  transformers under ``root/subdir`` (``subdir=""``: ``root`` itself); returns (directory, model).
- ``tiny_megatron_model(hf_dir, layout)`` (in a rank): that checkpoint as a Megatron model set up for
  training in ``layout``.
- fixture ``tiny_hf_checkpoint`` (session scope, so module fixtures use it too):
  ``tiny_hf_checkpoint(family, seed=0, subdir="hf", **overrides)`` does the same in a fresh temporary
  directory.

Rank functions and worker scripts import this module directly (tests/ is on their ``sys.path``).
"""

from __future__ import annotations

import os


def tiny_family(family: str):
    """The registered family named ``family`` (or whose model_type it is) that has a tiny config."""
    from gspo_megatron.models.registry import families, family_for_model_type

    found = next((f for f in families() if f.name == family), None) or family_for_model_type(family)
    if found is None or not found.tiny:
        raise ValueError(f"no tiny config for {family!r}")
    return found


def tiny_hf_config(family: str, **overrides) -> dict:
    """``family``'s tiny HF config (model_type: the family's first, e.g. qwen3_5_moe_text) + ``overrides``."""
    f = tiny_family(family)
    return {**f.tiny, "model_type": f.model_types[0], **overrides}


def write_tiny_hf_checkpoint(root, family: str, seed: int = 0, subdir: str = "hf", **overrides):
    """``save_tiny_hf_model(family, root/subdir, seed, **overrides)``; returns (that directory, the model)."""
    from gspo_megatron.models.tiny import save_tiny_hf_model

    path = os.path.join(str(root), subdir) if subdir else str(root)
    return path, save_tiny_hf_model(family, path, seed=seed, **overrides)


def tiny_megatron_model(
    hf_dir: str, layout: dict, impl: str = "local", dtype: str = "float32", mtp: bool = False, recompute: bool = False
):
    """In a rank: ``init_distributed`` for ``layout`` ({"tp", "pp", "ep"}: each 1 when absent; sequence
    parallel with tp > 1; seed 0), the Megatron model of ``hf_dir`` with its weights loaded (``mtp``: its
    MTP layers too, ``ModelOptions.mtp``; ``recompute``: ``ModelOptions.recompute``), set up for training without the distributed optimizer; returns
    ``setup_training``'s (ddp, optimizer, scheduler)."""
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training

    init_distributed(ParallelLayout(**layout, sequence_parallel=layout.get("tp", 1) > 1), seed=0)
    model = build_model(
        load_hf_config(hf_dir),
        layout.get("tp", 1),
        layout.get("pp", 1),
        layout.get("ep", 1),
        opts=ModelOptions(transformer_impl=impl, dtype=dtype, recompute=recompute, **({"mtp": True} if mtp else {})),
    )
    load_hf_weights(model, hf_dir)
    return setup_training(model, OptimOptions(use_distributed_optimizer=False))
