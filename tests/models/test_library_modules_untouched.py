"""Building a model leaves Megatron-Core's modules as they were: the local spec's MLA
(``models/deepseek_v3/local_attention.py``) clears ``multi_latent_attention.HAVE_TE`` for its own
constructor only and gathers ``linear_kv_down_proj``'s output in a hook of its own instead of replacing
the module's ``gather_from_tensor_model_parallel_region``; Qwen3-Next's Gated DeltaNet sets
``gated_delta_net.HAVE_FLA`` for its constructor only. Both through ``runtime.scoped_attrs.module_attrs``,
whose restore (an exception included) is checked here on its own."""

from __future__ import annotations

import types

import pytest

from distributed_harness import run_ranks

KINDS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next")


def _build(rank, world, kinds):
    """Per kind: (the library attributes equal before and after building it, MLA layers built as
    ``LocalMLASelfAttention``); plus whether MLA's gather is still Megatron's own function."""
    from megatron.core.ssm import gated_delta_net as mgdn
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import multi_latent_attention as mla

    from gspo_megatron.models.build import build_model
    from gspo_megatron.models.deepseek_v3.local_attention import LocalMLASelfAttention
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from tiny_models import tiny_hf_config

    init_distributed(ParallelLayout())

    def attrs():
        return (mla.HAVE_TE, mla.gather_from_tensor_model_parallel_region, mgdn.HAVE_FLA)

    out = {}
    for kind in kinds:
        before = attrs()
        model = build_model(tiny_hf_config(kind))
        after = attrs()
        mla_layers = [type(m) for m in model.modules() if isinstance(m, mla.MLASelfAttention)]
        out[kind] = (
            all(a is b for a, b in zip(before, after)),
            len(mla_layers),
            all(t is LocalMLASelfAttention for t in mla_layers),
        )
    out["gather is megatron's"] = mla.gather_from_tensor_model_parallel_region is (
        mappings.gather_from_tensor_model_parallel_region
    )
    return out


def test_building_models_leaves_megatron_module_attributes_unchanged():
    got = run_ranks(_build, 1, KINDS)[0]
    assert got.pop("gather is megatron's") is True
    for kind, (unchanged, n_mla, local) in got.items():
        assert unchanged, f"{kind}: building the model changed a Megatron-Core module attribute"
        if kind != "qwen3_next":
            assert n_mla > 0 and local, kind


def test_module_attrs_restores_after_the_block_and_after_an_exception():
    from gspo_megatron.runtime.scoped_attrs import module_attrs

    mod = types.ModuleType("fake_library")
    mod.FLAG, mod.OTHER = False, 1
    with module_attrs(mod, FLAG=True, OTHER=2):
        assert (mod.FLAG, mod.OTHER) == (True, 2)
        with module_attrs(mod, FLAG="inner"):  # re-entrant (one thread)
            assert mod.FLAG == "inner"
        assert mod.FLAG is True
    assert (mod.FLAG, mod.OTHER) == (False, 1)
    with pytest.raises(RuntimeError):
        with module_attrs(mod, FLAG=True):
            raise RuntimeError("constructor failed")
    assert mod.FLAG is False
    with pytest.raises(AttributeError):  # only attributes the module has
        with module_attrs(mod, MISSING=1):
            pass
    assert not hasattr(mod, "MISSING")
