"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) on Transformer Engine's layer spec, on CPU
through the TE stand-in (``te_standin.py``: TE's parameter names and per-rank splits) as
``test_deepseek_v3_te.py`` does for DeepSeek-V3: the MLA linears are DeepSeek-V3's on TE (duplicated
down projections, q / kv norms fused into the up projections), the core attention is our
``DSALocalAttention`` with the indexer's own replicated parameters, bound to the fused q norm
(``te_attention.TEMLASelfAttention`` -> ``bind_fused_q_norm``). Checked in 1 rank, tp2 and ep2 for a
tiny V3.2 and a tiny GLM-5 with "shared" layers (full, shared, full, shared): every TE parameter is
covered by exactly one rule with the shape that rule gives this rank, HF -> Megatron (TE) -> HF is
bitwise, every HF tensor comes from exactly one Megatron tensor, the down projections count once in
the grad norm. The indexer's input on TE (``fused_rms_norm`` of ``q_a_proj(x)``) is checked bitwise
against transformers' ``q_a_layernorm``. The forward on TE is tests/gpu/test_deepseek_v3_te_gpu.py."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.models import get_family
from te_mla_workers import LAYOUTS, check_round_trip, check_te_rules, te_layout_runs

FSFS = ["full", "shared", "full", "shared"]
MODELS = {"deepseek_v32": {}, "glm_moe_dsa": {"indexer_types": FSFS}}


@pytest.fixture(scope="module")
def te_runs(tmp_path_factory):
    """{(model type, layout name): (hf config, HF tensors, per-rank results of te_mla_workers.te_layout)}."""
    from safetensors.torch import load_file

    from gspo_megatron.models.hf_config import load_hf_config
    from tiny_models import write_tiny_hf_checkpoint

    out = {}
    for model_type, overrides in MODELS.items():
        hf_dir, _ = write_tiny_hf_checkpoint(tmp_path_factory.mktemp(model_type), model_type, seed=5, **overrides)
        hf, full = load_hf_config(hf_dir), load_file(f"{hf_dir}/model.safetensors")
        for name, ranks in te_layout_runs(hf_dir).items():
            out[model_type, name] = (hf, full, ranks)
    return out


CASES = [(m, lay) for m in MODELS for lay in LAYOUTS]


@pytest.mark.parametrize("model_type,layout", CASES)
def test_every_te_parameter_has_exactly_one_rule_of_its_shape(te_runs, model_type, layout):
    hf, full, ranks = te_runs[model_type, layout]
    check_te_rules(ranks, get_family(hf).mapping(hf).for_spec(te=True), full, LAYOUTS[layout].get("tp", 1))


@pytest.mark.parametrize("model_type,layout", CASES)
def test_hf_to_megatron_te_to_hf_is_bitwise(te_runs, model_type, layout):
    hf, full, ranks = te_runs[model_type, layout]
    expected = check_round_trip(ranks, get_family(hf).mapping(hf).for_spec(te=True), full, hf)
    assert any(".indexer." in n for n in expected)  # the indexer's tensors go both ways too


@pytest.mark.parametrize("model_type", list(MODELS))
def test_te_dsa_layout(te_runs, model_type):
    """tp2: DeepSeek-V3's TE MLA linears, our DSA core attention in every layer with the indexer
    (replicated, whole on every rank) on full layers only, bound to its layer's fused q norm."""
    hf, full, ranks = te_runs[model_type, "tp2"]
    types = MODELS[model_type].get("indexer_types", ["full"] * 4)
    want = "InterleavedDSALocalAttention" if model_type == "glm_moe_dsa" else "DSALocalAttention"
    for res in ranks:
        t = res["tensors"]
        for layer, kind in enumerate(types):
            a = f"decoder.layers.{layer}.self_attention"
            assert t[f"{a}.linear_q_down_proj.weight"]["shape"] == (32, 64)
            assert t[f"{a}.linear_q_up_proj.layer_norm_weight"]["shape"] == (32,)
            assert not any(n.startswith(f"{a}.q_layernorm") for n in t)
            core = res["cores"][a]
            assert core == dict(cls=want, indexer=kind == "full", q_norm_bound=True), (a, core)
            idx = f"{a}.core_attention.indexer.linear_wq_b.weight"
            assert (idx in t) == (kind == "full")
            if kind == "full":
                assert torch.equal(res["values"][idx], full[f"model.layers.{layer}.self_attn.indexer.wq_b.weight"])


def test_fused_q_norm_is_transformers_q_a_layernorm_bitwise():
    """The indexer's input on TE: ``fused_rms_norm(linear_q_up_proj, q_a_proj(x))`` equals transformers'
    ``q_resid = q_a_layernorm(q_a_proj(x))`` bitwise in fp32 (same eps; zero-centered gamma: w + 1)."""
    from types import SimpleNamespace

    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RMSNorm

    from gspo_megatron.models.deepseek_v32.indexer import fused_rms_norm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 32, generator=g) * 3, torch.randn(32, generator=g)
    norm = DeepseekV32RMSNorm(32, eps=1e-6)
    norm.weight.data.copy_(w)
    linear = SimpleNamespace(layer_norm_weight=w, eps=1e-6, normalization="RMSNorm", zero_centered_gamma=False)
    assert torch.equal(fused_rms_norm(linear, x), norm(x))
    zc = SimpleNamespace(layer_norm_weight=w - 1, eps=1e-6, normalization="RMSNorm", zero_centered_gamma=True)
    torch.testing.assert_close(fused_rms_norm(zc, x), norm(x), rtol=1e-6, atol=1e-6)
    assert not torch.equal(fused_rms_norm(linear, x), x)


def test_transformer_engine_spec_accepted_for_dsa():
    for model_type in MODELS:
        get_family({"model_type": model_type}).check_transformer_impl(te=True)


@pytest.mark.parametrize("model_type", list(MODELS))
@pytest.mark.parametrize("tp,max_tokens", [(1, 0), (2, 0), (1, 40), (2, 40)])
def test_standin_forward_logprobs_equal_transformers(tmp_path, model_type, tp, max_tokens):
    """The TE-built model forwards through the stand-in's plain-torch TE modules (its fused norms,
    duplicated / column / row linears with their TP communication, grouped experts) and our DSA core
    attention: per-token log-probs equal transformers' within 1e-4 (fp32), GLM-5 with shared layers,
    in padded micro-batches and packed (THD, ``max_tokens`` per micro-batch) ones."""
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from hf_reference import hf_logprobs, make_rows, max_abs_diff
    from te_mla_workers import standin_logprobs

    model = save_tiny_hf_model(model_type, str(tmp_path / "hf"), seed=7, **MODELS[model_type])
    rows = make_rows(seed=2, n=7, vocab=256, max_len=23)
    ref = hf_logprobs(model.float(), rows)
    got = run_ranks(standin_logprobs, tp, str(tmp_path / "hf"), rows, tp, max_tokens)[0]
    assert max_abs_diff(got, ref) < 1e-4


def test_context_parallel_refused_by_megatron_core_config():
    """TE's spec would allow parallel.cp > 1 (validation.py refuses it only on the local spec):
    megatron-core 0.16.1's TransformerConfig refuses context parallelism with
    ``experimental_attention_variant="dsa"`` (an assertion, transformer_config.py), before any module
    is built; the indexer selects over each whole sequence."""
    from tiny_models import tiny_hf_config

    for model_type in MODELS:
        family = get_family({"model_type": model_type})
        fields = family.config_fields(tiny_hf_config(model_type))
        with pytest.raises(AssertionError, match="context parallelism is not supported by DSAttention"):
            family.megatron_config_class()(**fields, context_parallel_size=2)
