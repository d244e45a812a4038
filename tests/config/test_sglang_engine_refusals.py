"""Configs an SGLang engine would silently serve differently from the trainer are refused before any
start, in one line naming the field and what would work (issue 21 defects 6 and 10):

- ``rollout.sync_fp8`` with attached engines (``rollout.engine_urls``): launch/sglang_node.sh starts
  them from the bf16 checkpoint, so sglang has no parameter for ``weight_scale_inv`` and casts the e4m3
  bytes into bf16 weights;
- Qwen2-MoE / Qwen3-MoE with dense layers (``mlp_only_layers`` / ``decoder_sparse_step``): sglang
  0.5.23 builds every layer sparse, so the dense layers would never be written;
- ``tie_word_embeddings: true`` on a family whose sglang class keeps ``lm_head`` apart from
  ``embed_tokens`` (the sync of a tied model sends no ``lm_head.weight``).

The families' flags are checked against sglang's own source (the installed package), so a change
there turns this red. The real server, the CPU stand-in (``rollout.engine_server=cpu``) and attached
engines are refused alike: the check is the config validation every one of them goes through.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys

import pytest

from gspo_megatron.config import load_config, validate_model_layout
from gspo_megatron.errors import ConfigError
from gspo_megatron.models.registry import families, family_for_model_type
from subprocess_utils import run_group
from tiny_models import tiny_hf_config

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_SPEC = importlib.util.find_spec("sglang")
SGLANG_DIR = _SPEC.submodule_search_locations[0] if _SPEC else None
needs_sglang_source = pytest.mark.skipif(SGLANG_DIR is None, reason="sglang (installed --no-deps) not found")

DISAGG = ["rollout.engine=sglang", "rollout.sync_mode=disaggregated", "rollout.engine_urls=[http://a:1,http://b:1]"]
ENGINES = {
    "sglang": ["rollout.engine=sglang", "rollout.sync_mode=colocated"],
    "cpu": ["rollout.engine=sglang", "rollout.sync_mode=colocated", "rollout.engine_server=cpu"],
    "attached": ["rollout.engine=sglang", "rollout.sync_mode=disaggregated", "rollout.engine_urls=[http://a:1]"],
}


def _cfg(*overrides):
    return load_config(None, list(overrides), check_files=False)


def _error(cfg, hf) -> str:
    with pytest.raises(ConfigError) as err:
        validate_model_layout(cfg, hf)
    msg = str(err.value)
    assert "\n" not in msg.strip(), msg
    return msg


# -- defect 6 --------------------------------------------------------------------------------------------
def test_sync_fp8_with_attached_engines_is_refused_naming_both_fields():
    with pytest.raises(ConfigError) as err:
        _cfg(*DISAGG, "rollout.sync_fp8=true")
    msg = str(err.value)
    assert "\n" not in msg.strip(), msg
    assert "rollout.sync_fp8=true is not supported with rollout.engine_urls" in msg
    assert "set rollout.sync_fp8=false" in msg
    _cfg(*DISAGG)  # bf16 sync with attached engines is fine
    _cfg("rollout.engine=sglang", "rollout.sync_mode=disaggregated", "rollout.num_engines=2", "rollout.sync_fp8=true")


def test_sync_fp8_with_the_cpu_stand_in_is_refused():
    """The CPU server reads no quantization_config: it would load e4m3 bytes as float weights."""
    with pytest.raises(ConfigError) as err:
        _cfg(*ENGINES["cpu"], "rollout.sync_fp8=true")
    msg = str(err.value)
    assert "\n" not in msg.strip(), msg
    assert "rollout.sync_fp8=true is not supported with rollout.engine_server=cpu" in msg


# -- defect 10 (a): dense layers of Qwen-MoE ---------------------------------------------------------------
@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize(
    "family, changes, dense",
    [
        ("qwen3_moe", dict(mlp_only_layers=[1]), [1]),
        ("qwen3_moe", dict(decoder_sparse_step=2), [0, 2]),
        ("qwen2_moe", dict(mlp_only_layers=[1]), [1]),
        ("qwen2_moe", dict(mlp_only_layers=[], decoder_sparse_step=2), [0, 2]),
    ],
)
def test_qwen_moe_dense_layers_are_refused_with_sglang_engines(engine, family, changes, dense):
    hf = tiny_hf_config(family, **changes)
    msg = _error(_cfg(*ENGINES[engine]), hf)
    assert f"(dense layers {dense}) is not supported with rollout.engine=sglang" in msg
    assert "use mlp_only_layers: [] and decoder_sparse_step: 1, or rollout.engine=hf" in msg
    validate_model_layout(_cfg(), hf)  # the in-process transformers engine builds them as the trainer does
    validate_model_layout(_cfg(*ENGINES[engine]), tiny_hf_config(family, mlp_only_layers=[], decoder_sparse_step=1))


# -- defect 10 (b): tied embeddings --------------------------------------------------------------------------
UNTIED_IN_SGLANG = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss", "minimax_m2", "qwen3_next"]
TIED_IN_SGLANG = ["qwen2", "qwen3", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_5_moe"]


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("family", UNTIED_IN_SGLANG)
def test_tied_embeddings_refused_where_sglang_keeps_lm_head_apart(engine, family):
    hf = tiny_hf_config(family, tie_word_embeddings=True)
    if family == "qwen2_moe":
        hf["mlp_only_layers"] = []
    msg = _error(_cfg(*ENGINES[engine]), hf)
    assert msg.startswith(
        f"config.json tie_word_embeddings=true is not supported with rollout.engine=sglang for {family}"
    )
    assert "use an untied checkpoint (tie_word_embeddings: false, with lm_head.weight) or rollout.engine=hf" in msg
    validate_model_layout(_cfg(), hf)


@pytest.mark.parametrize("family", TIED_IN_SGLANG)
def test_tied_embeddings_accepted_where_sglang_ties(family):
    validate_model_layout(_cfg(*ENGINES["sglang"]), tiny_hf_config(family, tie_word_embeddings=True))


def test_every_family_is_classified():
    assert sorted(UNTIED_IN_SGLANG + TIED_IN_SGLANG) == sorted(f.name for f in families())


# -- the flags agree with sglang 0.5.23's model classes -------------------------------------------------------
SGLANG_FILES = {
    "qwen3_moe": "qwen3_moe.py",
    "qwen2_moe": "qwen2_moe.py",
    "mixtral": "mixtral.py",
    "glm4_moe": "glm4_moe.py",
    "gpt_oss": "gpt_oss.py",
    "qwen2": "qwen2.py",
    "qwen3": "qwen3.py",
    "deepseek_v3": "deepseek_v2.py",
    "deepseek_v32": "deepseek_v2.py",
    "minimax_m2": "minimax_m2.py",
    "qwen3_next": "qwen3_next.py",
}


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    """The class ``name``, following a body-less subclass to its base in the same module."""
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    if not any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in cls.body):
        return _class(tree, cls.bases[0].id)
    return cls


@needs_sglang_source
@pytest.mark.parametrize("family", sorted(SGLANG_FILES))
def test_family_flags_agree_with_sglang_source(family):
    f = family_for_model_type(family)
    tree = ast.parse(open(os.path.join(SGLANG_DIR, "srt/models", SGLANG_FILES[family])).read())
    init = ast.unparse(
        next(
            n for n in _class(tree, f.architectures[0]).body if isinstance(n, ast.FunctionDef) and n.name == "__init__"
        )
    )
    assert ("self.lm_head = self.model.embed_tokens" in init) == f.sglang_ties_lm_head, family
    if f.sglang_every_layer_sparse:  # the decoder layer declares every layer sparse, whatever the config
        layer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("DecoderLayer"))
        funcs = {n.name: n for n in layer.body if isinstance(n, ast.FunctionDef)}
        facts = ast.unparse(funcs.get("stage_facts") or funcs["__init__"])  # qwen3_next.py: set in __init__
        assert "is_layer_sparse = True" in facts and "mlp_only_layers" not in facts
        assert "decoder_sparse_step" not in open(os.path.join(SGLANG_DIR, "srt/models", SGLANG_FILES[family])).read()


# -- gspo-train --check reports them: one line, exit 2 ---------------------------------------------------------
def _check(*args):
    return run_group(
        [sys.executable, "-m", "gspo_megatron.train", "--check", *args],
        timeout=180,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def test_check_reports_them_in_one_line(tmp_path):
    proc = _check("--config", "configs/demo_cpu.yaml", f"output_dir={tmp_path}/a", *DISAGG, "rollout.sync_fp8=true")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.sync_fp8=true is not supported with rollout.engine_urls" in lines[0], (
        proc.stderr
    )
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(tiny_hf_config("qwen3_moe", mlp_only_layers=[1])))
    proc = _check(
        "--config",
        "configs/demo_cpu.yaml",
        f"output_dir={tmp_path}/b",
        f"model.hf_path={hf}",
        "model.arch=null",
        *ENGINES["cpu"],
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "mlp_only_layers=[1]" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
