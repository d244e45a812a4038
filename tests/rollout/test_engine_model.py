"""The SGLang engine's model dir and server args (engines/engine_model.py), checked against sglang
0.5.23's own code.

sglang's server modules do not import on CPU (its quantization package pulls CUDA kernels), so the
few pure functions that decide what an FP8 engine accepts are taken from the installed sglang source
by name (``ast``) and run here with stubs for logging / env flags: ``Fp8Config.__init__`` +
``from_config`` (+ ``QuantizationConfig.get_from_keys[_or]``), ``check_quantized_moe_compatibility``
(the per-rank MoE size rule), ``Fp8LinearMethod.validate_block_quant_shapes`` and
``FusedMoE.make_expert_params_mapping``. If sglang's source changes shape these tests fail loudly.
"""

from __future__ import annotations
import __future__

import ast
import importlib.util
import json
import os
from types import SimpleNamespace

import pytest
import torch

from gspo_megatron.config import load_config, validate_model_layout
from gspo_megatron.engines.engine_model import FP8_QUANTIZATION_CONFIG, engine_layout_errors, prepare_engine_model_dir
from gspo_megatron.errors import ConfigError
from gspo_megatron.models.arch import KNOWN_ARCHS
from gspo_megatron.planner import ModelDims
from gspo_megatron.weight_sync.fp8_quant import quantize_bucket_fp8

_SPEC = importlib.util.find_spec("sglang")
SGLANG_DIR = _SPEC.submodule_search_locations[0] if _SPEC else None
needs_sglang_source = pytest.mark.skipif(SGLANG_DIR is None, reason="sglang (installed --no-deps) not found")


def _source(rel: str) -> ast.Module:
    with open(os.path.join(SGLANG_DIR, rel)) as f:
        return ast.parse(f.read())


def _find(tree: ast.AST, name: str, kind=(ast.FunctionDef, ast.ClassDef)):
    for node in ast.walk(tree):
        if isinstance(node, kind) and node.name == name:
            return node
    raise AssertionError(f"sglang source has no {name}")


def _run(nodes: list[ast.stmt], namespace: dict) -> dict:
    module = ast.Module(body=nodes, type_ignores=[])
    ast.fix_missing_locations(module)
    exec(compile(module, "<sglang>", "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace)
    return namespace


class _Flag:
    def __init__(self, value=None):
        self.value = value

    def get(self):
        return self.value


_ENVS = SimpleNamespace(SGLANG_FP8_IGNORED_LAYERS=_Flag(None), SGLANG_SHARED_EXPERT_TP1=_Flag(False))


@pytest.fixture(scope="module")
def sglang_fp8():
    """sglang's Fp8Config (constructor and from_config) over its QuantizationConfig.get_from_keys[_or]."""
    fp8, base = _source("srt/layers/quantization/fp8.py"), _source("srt/layers/quantization/base_config.py")
    qc = _find(base, "QuantizationConfig", ast.ClassDef)
    qc_methods = [_find(qc, n, ast.FunctionDef) for n in ("get_from_keys", "get_from_keys_or")]
    fc = _find(fp8, "Fp8Config", ast.ClassDef)
    fc_methods = [_find(fc, n, ast.FunctionDef) for n in ("__init__", "get_name", "from_config")]
    schemes = next(
        n for n in fp8.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "ACTIVATION_SCHEMES"
    )
    classes = [
        ast.ClassDef(
            name="QuantizationConfig",
            bases=[],
            keywords=[],
            decorator_list=[],
            body=[ast.parse("def __init__(self): pass").body[0], *qc_methods],
            type_params=[],
        ),
        ast.ClassDef(
            name="Fp8Config",
            bases=[ast.Name("QuantizationConfig", ast.Load())],
            keywords=[],
            decorator_list=[],
            body=fc_methods,
            type_params=[],
        ),
    ]
    import logging

    ns = _run(
        [schemes, *classes],
        {
            "envs": _ENVS,
            "logger": logging.getLogger("sglang-stub"),
            "log_info_on_rank0": lambda *a, **k: None,
            "Any": object,
        },
    )
    return ns["Fp8Config"]


@pytest.fixture(scope="module")
def sglang_rules():
    """sglang's MoE rule, its linear block-shape rule and its expert checkpoint-name mapping."""
    moe = _find(
        _source("srt/model_executor/model_runner_components/moe_ep_setup.py"), "check_quantized_moe_compatibility"
    )
    validate = _find(
        _find(_source("srt/layers/quantization/fp8.py"), "Fp8LinearMethod", ast.ClassDef), "validate_block_quant_shapes"
    )
    mapping = _find(
        _find(_source("srt/layers/moe/fused_moe_triton/layer.py"), "FusedMoE", ast.ClassDef),
        "make_expert_params_mapping",
    )
    for fn in (validate, mapping):
        fn.decorator_list = []
    ns = _run([moe, validate, mapping], {"envs": _ENVS, "_use_aiter": False, "print_warning_once": print})
    return SimpleNamespace(
        moe=ns["check_quantized_moe_compatibility"],
        linear=ns["validate_block_quant_shapes"],
        expert_mapping=lambda n: ns["make_expert_params_mapping"](None, "gate_proj", "down_proj", "up_proj", n),
    )


def _cfg(*overrides):
    return load_config(None, ["rollout.engine=sglang", "rollout.sync_mode=colocated", *overrides], check_files=False)


# a tiny Qwen3-MoE whose FP8 layout works at engine TP1 / TP2 x EP2 (head_dim 128, expert size 256)
TINY = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    for name, text in [
        ("tokenizer.json", "{}"),
        ("tokenizer_config.json", "{}"),
        ("generation_config.json", "{}"),
        ("model.safetensors", "weights"),
        ("model.safetensors.index.json", "{}"),
    ]:
        (d / name).write_text(text)
    return str(d)


@needs_sglang_source
def test_fp8_engine_dir_is_what_sglang_loads_as_block_fp8(hf_dir, tmp_path, sglang_fp8):
    cfg = _cfg("rollout.sync_fp8=true", "rollout.engine_tp=2", "rollout.engine_ep=2", "rollout.num_engines=1")
    path, args = prepare_engine_model_dir(cfg, hf_dir, str(tmp_path / "engine"))
    assert path == str(tmp_path / "engine")
    assert args == ["--load-format", "dummy"]  # --ep-size: fleet/engine_args.py (tests/rollout/test_engine_args.py)
    assert sorted(os.listdir(path)) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]  # no weights: they come with the first sync
    written = json.loads(open(os.path.join(path, "config.json")).read())
    assert {k: v for k, v in written.items() if k != "quantization_config"} == TINY
    q = sglang_fp8.from_config(written["quantization_config"])  # as sglang's ModelConfig hands it over
    assert q.get_name() == "fp8" and q.is_checkpoint_fp8_serialized
    assert q.weight_block_size == [128, 128] and q.activation_scheme == "dynamic"
    assert not q.use_mxfp8 and q.ignored_layers == []
    # again into the same dir (every node of a multi-node engine writes it): same result
    assert prepare_engine_model_dir(cfg, hf_dir, path) == (path, args)


@needs_sglang_source
def test_sglang_reference_refuses_what_the_dir_avoids(sglang_fp8):
    """The extracted sglang code is alive: it refuses block FP8 without 'dynamic' or without the scheme."""
    with pytest.raises(ValueError, match="dynamic activation scheme"):
        sglang_fp8.from_config({**FP8_QUANTIZATION_CONFIG, "activation_scheme": "static"})
    with pytest.raises(ValueError, match="activation_scheme"):
        sglang_fp8.from_config({k: v for k, v in FP8_QUANTIZATION_CONFIG.items() if k != "activation_scheme"})
    assert sglang_fp8.from_config({"quant_method": "fp8", "activation_scheme": "dynamic"}).weight_block_size is None


def test_bf16_engine_starts_from_the_hf_dir(hf_dir, tmp_path):
    out = str(tmp_path / "unused")
    assert prepare_engine_model_dir(_cfg(), hf_dir, out) == (hf_dir, [])
    assert prepare_engine_model_dir(
        _cfg("rollout.engine_tp=2", "rollout.engine_ep=2", "rollout.num_engines=1"), hf_dir, out
    ) == (hf_dir, [])
    assert not os.path.exists(out)


def test_already_quantized_checkpoint_refused(tmp_path):
    d = tmp_path / "fp8ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**TINY, "quantization_config": FP8_QUANTIZATION_CONFIG}))
    with pytest.raises(ConfigError, match="already has a quantization_config"):
        prepare_engine_model_dir(_cfg("rollout.sync_fp8=true"), str(d), str(tmp_path / "e"))


QWEN3_30B = KNOWN_ARCHS["qwen3-30b-a3b"]
QWEN3_235B = KNOWN_ARCHS["qwen3-235b-a22b"]
# dense families (config.json values of Qwen/Qwen3-8B and Qwen/Qwen2.5-0.5B)
QWEN3_8B = {
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}
QWEN25_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
}
ARCHS = {
    "qwen3-30b-a3b": QWEN3_30B,
    "qwen3-235b-a22b": QWEN3_235B,
    "mixtral-8x7b": KNOWN_ARCHS["mixtral-8x7b"],
    "qwen3-8b": QWEN3_8B,
    "qwen2.5-0.5b": QWEN25_05B,
}


@pytest.mark.parametrize(
    "arch, tp, ep, fp8, expected",
    [
        (
            QWEN3_30B,
            8,
            1,
            True,
            "rollout.sync_fp8: the expert intermediate size per engine rank, 768 / "
            "(rollout.engine_tp / rollout.engine_ep) = 768 / (8 / 1) = 96, must be a multiple "
            "of 128 (SGLang's block-FP8 MoE); set rollout.engine_ep to one of [4, 8]",
        ),
        (QWEN3_30B, 8, 2, True, "= 768 / (8 / 2) = 192, must be a multiple of 128"),
        (
            QWEN3_235B,
            16,
            2,
            True,
            "= 1536 / (16 / 2) = 192, must be a multiple of 128 (SGLang's block-FP8 MoE); "
            "set rollout.engine_ep to one of [4, 8, 16]",
        ),
        (QWEN3_30B, 8, 1, False, None),
        (QWEN3_30B, 8, 4, True, None),
        (QWEN3_235B, 16, 4, True, None),
        (QWEN3_8B, 4, 2, False, "rollout.engine_ep=2 needs an MoE model; qwen3 has no experts"),
        (
            dict(QWEN3_30B, moe_intermediate_size=102),
            8,
            2,
            False,
            "rollout.engine_tp / rollout.engine_ep = 8 / 2 = 4 (SGLang's moe_tp_size) must divide the expert intermediate size 102",
        ),
        (dict(QWEN3_30B, num_experts=6), 4, 4, False, "rollout.engine_ep=4 must divide the number of experts 6"),
        (
            QWEN25_05B,
            2,
            1,
            True,
            "rollout.sync_fp8: the attention q / k / v partitions per engine rank (448 / 64 / 64 at "
            "rollout.engine_tp=2, head_dim 64) must be multiples of 128",
        ),
    ],
)
def test_engine_layout_refusals_name_the_fields(arch, tp, ep, fp8, expected):
    cfg = _cfg(f"rollout.engine_tp={tp}", f"rollout.engine_ep={ep}", f"rollout.sync_fp8={str(fp8).lower()}")
    if expected is None:
        validate_model_layout(cfg, arch)
        return
    with pytest.raises(ConfigError) as err:
        validate_model_layout(cfg, arch)
    assert expected in str(err.value) and "\n" not in str(err.value).strip()


def test_engine_ep_static_checks():
    with pytest.raises(
        ConfigError, match="rollout.engine_ep=3 needs rollout.engine=sglang and must divide rollout.engine_tp=8"
    ):
        _cfg("rollout.engine_tp=8", "rollout.engine_ep=3")
    with pytest.raises(ConfigError, match="rollout.engine_ep=2 needs rollout.engine=sglang"):
        load_config(None, ["rollout.engine_ep=2"], check_files=False)
    with pytest.raises(ConfigError, match="rollout.engine_ep must be > 0"):
        _cfg("rollout.engine_ep=0")


@needs_sglang_source
@pytest.mark.parametrize("arch", ["qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b"])
def test_moe_rule_agrees_with_sglang(arch, sglang_rules):
    """For every (engine_tp, engine_ep) our MoE errors are non-empty exactly when sglang's
    check_quantized_moe_compatibility raises for the block-FP8 config."""
    hf = ARCHS[arch]
    dims = ModelDims.from_hf_config(hf)
    mc = SimpleNamespace(
        hf_config=SimpleNamespace(quantization_config=FP8_QUANTIZATION_CONFIG),
        hf_text_config=SimpleNamespace(moe_intermediate_size=dims.moe_ffn_hidden),
    )
    checked = 0
    for tp in (1, 2, 4, 8, 16, 32):
        for ep in (e for e in (1, 2, 4, 8, 16, 32) if tp % e == 0 and dims.num_experts % e == 0):
            ours = [
                m
                for m in engine_layout_errors(
                    _cfg(f"rollout.engine_tp={tp}", f"rollout.engine_ep={ep}", "rollout.sync_fp8=true"), dims
                )
                if "expert intermediate" in m or "moe_tp_size" in m
            ]
            try:
                sglang_rules.moe(model_config=mc, tp_size=tp, moe_ep_size=ep, moe_dp_size=1)
                theirs = False
            except ValueError:
                theirs = True
            assert bool(ours) == theirs, (tp, ep, ours)
            checked += 1
    assert checked > 10


@needs_sglang_source
@pytest.mark.parametrize("arch", list(ARCHS))
def test_linear_rules_agree_with_sglang(arch, sglang_rules):
    """Attention q/k/v (merged) and o_proj, dense gate_up (merged) and down_proj: our FP8 errors are
    non-empty exactly when sglang's validate_block_quant_shapes raises for one of them."""
    dims = ModelDims.from_hf_config(ARCHS[arch])
    quant = SimpleNamespace(weight_block_size=[128, 128])
    for tp in (1, 2, 4, 8, 16):
        if dims.num_heads % tp:
            continue
        layer = SimpleNamespace(tp_group=SimpleNamespace(world_size=tp))
        hd, q = dims.head_dim, dims.num_heads * dims.head_dim
        kv_part = max(1, dims.num_kv_heads // tp) * hd
        kv_total = kv_part * tp  # sglang's total for replicated kv heads
        shapes = [  # (input, input/partition, output, output/partition, output partitions)
            (dims.hidden, dims.hidden, q + 2 * kv_total, q // tp + 2 * kv_part, [q // tp, kv_part, kv_part]),
            (q, q // tp, dims.hidden, dims.hidden, [dims.hidden]),
        ]
        if dims.num_dense_layers and dims.ffn_hidden % tp == 0:
            f = dims.ffn_hidden
            shapes += [
                (dims.hidden, dims.hidden, 2 * f, 2 * f // tp, [f // tp, f // tp]),
                (f, f // tp, dims.hidden, dims.hidden, [dims.hidden]),
            ]
        theirs = False
        for args in shapes:
            try:
                sglang_rules.linear(layer, quant, *args)
            except ValueError:
                theirs = True
        ours = [
            m
            for m in engine_layout_errors(_cfg(f"rollout.engine_tp={tp}", "rollout.sync_fp8=true"), dims)
            if "linear layers" in m
        ]
        assert bool(ours) == theirs, (arch, tp, ours)


@needs_sglang_source
def test_fp8_sync_names_and_scale_shapes_match_sglang_parameters(sglang_rules):
    """quantize_bucket_fp8's output for HF Qwen3-MoE names: every '<m>.weight_scale_inv' lands, by
    sglang's own checkpoint-name mapping, on the parameter sglang creates for block FP8
    ('weight_scale_inv' of the merged linear, 'experts.w13_/w2_weight_scale_inv' of FusedMoE), with the
    per-expert / per-shard shape sglang's BlockQuantScaleParameter expects: ceil(out/128) x ceil(in/128)."""
    h, f, e = 256, 384, 2
    bucket = [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(4 * 128, h)),
        ("model.layers.0.self_attn.o_proj.weight", torch.randn(h, 4 * 128)),
        ("model.layers.0.mlp.gate.weight", torch.randn(e, h)),
        ("model.layers.0.input_layernorm.weight", torch.randn(h)),
    ]
    for i in range(e):
        bucket += [
            (f"model.layers.0.mlp.experts.{i}.gate_proj.weight", torch.randn(f, h)),
            (f"model.layers.0.mlp.experts.{i}.up_proj.weight", torch.randn(f, h)),
            (f"model.layers.0.mlp.experts.{i}.down_proj.weight", torch.randn(h, f)),
        ]
    out = dict(quantize_bucket_fp8(bucket))
    scales = {n: t for n, t in out.items() if n.endswith("_scale_inv")}
    assert {n for n, t in out.items() if t.dtype == torch.float8_e4m3fn} == {n[: -len("_scale_inv")] for n in scales}
    assert "model.layers.0.mlp.gate.weight" not in {n[: -len("_scale_inv")] for n in scales}  # router stays bf16
    mapping = sglang_rules.expert_mapping(e)
    for name, s in scales.items():
        w = out[name[: -len("_scale_inv")]]
        assert s.dtype == torch.float32
        assert tuple(s.shape) == ((w.shape[0] + 127) // 128, (w.shape[1] + 127) // 128)
        if ".experts." in name:
            hits = [param for param, weight, _, _ in mapping if weight in name]
            assert len(hits) == 1
            assert name.replace(next(w_ for _, w_, _, _ in mapping if w_ in name), hits[0]).endswith(
                ("experts.w13_weight_scale_inv", "experts.w2_weight_scale_inv")
            )
        else:
            assert name.endswith(".weight_scale_inv")


# -- issue 21 defect 7: gpt-oss with FP8 sync (only attention is quantized on sync) -----------------------


@pytest.fixture(scope="module")
def sglang_is_layer_skipped():
    """sglang's is_layer_skipped (with _module_path_match and _FALLBACK_FUSED_SHARDS), which
    Fp8Config.get_quant_method asks for every LinearBase and FusedMoE prefix."""
    utils = _source("srt/layers/quantization/utils.py")
    nodes = [_find(utils, "_module_path_match"), _find(utils, "is_layer_skipped")]
    fallback = next(
        n
        for n in utils.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        and "_FALLBACK_FUSED_SHARDS" in ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target)
    )
    from types import MappingProxyType
    from typing import List, Mapping

    ns = _run([fallback, *nodes], {"Mapping": Mapping, "List": List, "MappingProxyType": MappingProxyType})
    return ns["is_layer_skipped"]


GPT_OSS = KNOWN_ARCHS["gpt-oss-120b"]  # 36 layers, 64 heads of 64, 8 kv heads, expert intermediate 2880


@needs_sglang_source
def test_gpt_oss_fp8_engine_keeps_its_experts_unquantized(tmp_path, sglang_fp8, sglang_is_layer_skipped):
    """gpt-oss's stacked experts are synced in bf16 (only q/k/v/o are quantized): the FP8 engine's
    quantization_config lists them in modules_to_not_convert, so sglang's Fp8Config skips them (its
    get_quant_method then gives their FusedMoE UnquantizedFusedMoEMethod, not Fp8MoEMethod) while the
    attention projections stay block FP8."""
    d = tmp_path / "gpt-oss"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(GPT_OSS))
    cfg = _cfg("rollout.sync_fp8=true", "rollout.engine_tp=2")
    path, _ = prepare_engine_model_dir(cfg, str(d), str(tmp_path / "engine"))
    q = json.loads(open(os.path.join(path, "config.json")).read())["quantization_config"]
    layers = GPT_OSS["num_hidden_layers"]
    assert q["modules_to_not_convert"] == [f"model.layers.{i}.mlp.experts" for i in range(layers)]
    fp8 = sglang_fp8.from_config(q)
    skipped = lambda prefix: sglang_is_layer_skipped(prefix, fp8.ignored_layers, fused_mapping={})
    for i in range(layers):
        assert skipped(f"model.layers.{i}.mlp.experts")
        assert not skipped(f"model.layers.{i}.self_attn.qkv_proj") and not skipped(f"model.layers.{i}.self_attn.o_proj")
    # the prefixes are the ones gpt-oss builds, and the FusedMoE branch honours the skip
    src = open(os.path.join(SGLANG_DIR, "srt/models/gpt_oss.py")).read()
    assert 'prefix=add_prefix("experts", prefix)' in src and 'prefix=add_prefix("mlp", prefix)' in src
    quant = ast.unparse(
        _find(_find(_source("srt/layers/quantization/fp8.py"), "Fp8Config", ast.ClassDef), "get_quant_method")
    )
    moe_branch = quant[quant.index("isinstance(layer, FusedMoE)") :]
    assert (
        moe_branch.index("is_layer_skipped")
        < moe_branch.index("UnquantizedFusedMoEMethod")
        < moe_branch.index("Fp8MoEMethod(self)")
    )
    # a family whose experts are quantized on sync keeps them FP8
    tiny = tmp_path / "qwen"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(TINY))
    path, _ = prepare_engine_model_dir(cfg, str(tiny), str(tmp_path / "engine2"))
    q = json.loads(open(os.path.join(path, "config.json")).read())["quantization_config"]
    assert "modules_to_not_convert" not in q and not sglang_fp8.from_config(q).ignored_layers


def test_gpt_oss_fp8_layout_checks_only_what_the_engine_quantizes():
    """The block-FP8 MoE size rule is not applied to gpt-oss's unquantized experts (sglang applies it only
    to configs with moe_intermediate_size, which gpt-oss has not); the attention rule still is."""
    for tp in (1, 2, 4):
        validate_model_layout(_cfg("rollout.sync_fp8=true", f"rollout.engine_tp={tp}"), GPT_OSS)
    with pytest.raises(ConfigError) as err:
        validate_model_layout(_cfg("rollout.sync_fp8=true", "rollout.engine_tp=8"), GPT_OSS)
    assert "attention q / k / v partitions" in str(err.value) and "expert intermediate" not in str(err.value)
