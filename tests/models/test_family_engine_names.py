"""What the engines look up by name is each family's own fact, set in its folder (docs/adding_a_model.md):

- ``sglang_modules`` (HF architecture -> sglang 0.5.23's ``srt/models/<module>.py``),
  ``sglang_kept_from_start``, ``sglang_mamba_cache``: the CPU server's tables (``cpu_server/sglang_models.py``);
- ``hf_router_classes``, ``hf_router_perturbable``, ``hf_indexer_classes``: the transformers classes the CPU
  server records routed experts and DSA indexer selections from (``cpu_server/routes.py``);
- ``language_model_prefix``, ``language_model_excluded``: a vision-language checkpoint's language model
  (``engines/hf_engine.py``).

A family registered without them (or with a wrong one) fails here, checked against the installed sglang
source and the family's tiny transformers model; and no module of ``gspo_megatron`` outside ``models/``
names an architecture in code (the last test: a string constant that is not a docstring, or an import of
a family's folder).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib

import pytest
import torch
from transformers import AutoConfig

from gspo_megatron.cpu_server import routes, sglang_models
from gspo_megatron.engines import hf_engine
from gspo_megatron.models import hf_config
from gspo_megatron.models.family import moe_layer_pattern
from gspo_megatron.models.registry import families, family_for_model_type
from gspo_megatron.models.tiny import hf_model_from_config
from tiny_models import tiny_hf_config

PKG = pathlib.Path(__file__).resolve().parents[2] / "gspo_megatron"
_SPEC = importlib.util.find_spec("sglang")
SGLANG_MODELS = os.path.join(_SPEC.submodule_search_locations[0], "srt", "models") if _SPEC else None
needs_sglang_source = pytest.mark.skipif(SGLANG_MODELS is None, reason="sglang (installed --no-deps) not found")

FAMILIES = [f.name for f in families()]
# MoE families whose routes the CPU server does not record (``hf_router_classes = ()``): with
# ``--enable-return-routed-experts`` / ``--router-logit-perturbation`` its RouteRecorder finds no router and
# the server refuses at start. A new MoE family lists its router class, or joins this list on purpose.
ROUTES_NOT_RECORDED = ("deepseek_v3", "glm4_moe", "gpt_oss", "minimax_m2", "qwen3_next", "qwen3_5_moe")


def _family(name: str):
    return next(f for f in families() if f.name == name)


def _meta_model(f, cfg: dict):
    """The family's tiny transformers model (its own class) on the meta device: modules, no memory."""
    with torch.device("meta"):
        return hf_model_from_config(f.tiny_hf_config(dict(cfg)))


def test_engine_tables_are_the_families_facts():
    fams = list(families())
    assert sglang_models.MODULES == {a: m for f in fams for a, m in f.sglang_modules.items()}
    assert sglang_models.KEPT_FROM_START == {a: k for f in fams for a, k in f.sglang_kept_from_start.items()}
    assert set(sglang_models.LINEAR_ATTENTION_HYBRIDS) == {
        a for f in fams if f.sglang_mamba_cache for a in f.architectures
    }
    assert set(routes.ROUTER_CLASSES) == {c for f in fams for c in f.hf_router_classes}
    assert set(routes._NO_PERTURB) == {c for f in fams if not f.hf_router_perturbable for c in f.hf_router_classes}
    assert set(routes.INDEXER_CLASSES) == {c for f in fams for c in f.hf_indexer_classes}
    assert hf_engine.LANGUAGE_MODEL_PREFIXES == {
        mt: f.language_model_prefix for f in fams if f.language_model_prefix for mt in f.model_types
    }
    assert set(hf_engine._NOT_LANGUAGE_MODEL) == {p for f in fams for p in f.language_model_excluded}


@needs_sglang_source
@pytest.mark.parametrize("family", FAMILIES)
def test_every_architecture_names_the_sglang_module_that_serves_it(family):
    """Each architecture the family accepts has its sglang 0.5.23 module, whose ``EntryClass`` (what sglang's
    registry reads) lists a class of that name; what the class keeps from start-up is for its architectures."""
    f = _family(family)
    assert sorted(f.sglang_modules) == sorted(f.architectures), f"{family}: sglang_modules must cover architectures"
    for arch, module in f.sglang_modules.items():
        path = os.path.join(SGLANG_MODELS, f"{module}.py")
        assert os.path.isfile(path), f"{family}: sglang has no srt/models/{module}.py"
        tree = ast.parse(open(path).read())
        entry = next(
            n.value
            for n in tree.body
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EntryClass" for t in n.targets)
        )
        names = [e.id for e in (entry.elts if isinstance(entry, ast.List) else [entry]) if isinstance(e, ast.Name)]
        assert arch in names, f"{family}: srt/models/{module}.py EntryClass {names} lacks {arch}"
    assert set(f.sglang_kept_from_start) <= set(f.architectures)


@pytest.mark.parametrize("family", FAMILIES)
def test_mamba_cache_is_the_families_with_gated_deltanet_layers(family):
    f = _family(family)
    assert f.sglang_mamba_cache == bool(f.dims(tiny_hf_config(family)).linear_layers), family


@pytest.mark.parametrize("family", FAMILIES)
def test_router_and_indexer_classes_are_the_tiny_models(family):
    """The classes a family lists are its transformers model's, one router per MoE layer; a DSA family lists
    its indexer class; a softmax router may be perturbed, a sigmoid one (with bias) not."""
    f = _family(family)
    cfg = tiny_hf_config(family)
    model = _meta_model(f, cfg)
    names = {type(m).__name__ for m in model.modules()}
    in_model = {n for n in names if n.lower().endswith("topkrouter")}
    assert set(f.hf_indexer_classes) == {n for n in names if n.endswith("Indexer")}, family
    if not f.hf_router_classes:
        assert not in_model or family in ROUTES_NOT_RECORDED, (
            f"{family}: its transformers routers {sorted(in_model)} are not in hf_router_classes"
        )
        return
    assert family not in ROUTES_NOT_RECORDED
    assert set(f.hf_router_classes) == in_model, family
    layers = [i for i, _ in routes.find_routers(model)]
    assert layers == [i for i, moe in enumerate(moe_layer_pattern(cfg)) if moe], family
    sigmoid = f.config_fields(cfg).get("moe_router_score_function") == "sigmoid"
    assert f.hf_router_perturbable == (not sigmoid), family


@pytest.mark.parametrize("family, arch", [(f.name, a) for f in families() for a in f.architectures])
def test_language_model_prefix_of_each_architecture(family, arch):
    """A vision-language checkpoint (``text_config``) is served as its language model under the family's
    ``language_model_prefix``; what the sync carries besides it (the vision tower) is outside it."""
    f = _family(family)
    cfg = f.tiny_hf_config(dict(tiny_hf_config(family), architectures=[arch]))
    config = AutoConfig.for_model(
        cfg["model_type"], **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    )
    _, prefix = hf_engine.language_model_of(config)
    if "text_config" not in cfg:
        assert prefix is None, (family, arch)
        return
    assert prefix is not None and prefix == f.language_model_prefix, f"{family}: {arch} needs language_model_prefix"
    assert family_for_model_type(cfg["model_type"]) is f
    for carried in f.carried_prefixes(hf_config.lift_text_config(cfg)):
        assert carried.startswith(f.language_model_excluded), (family, carried)
        assert hf_engine.outside_language_model(carried + "x.weight", prefix)


def _engine_names() -> tuple[set[str], set[str], tuple[str, ...]]:
    """(class names matched as substrings, names matched as whole strings, family packages)."""
    within, whole, packages = set(), set(), set()
    for f in families():
        within.update(f.architectures + f.hf_router_classes + f.hf_indexer_classes)
        whole.update((f.name, *f.model_types, *f.sglang_modules.values()))
        packages.add(type(f).__module__)
    return within, whole, tuple(sorted(packages))


def architecture_names_in_code(root: pathlib.Path = PKG) -> list[str]:
    """``path:line: what`` for each string constant (not a docstring) of a module outside ``models/`` that
    holds an architecture / router / indexer class name or is a model_type / sglang module name, and each
    import of a family's package."""
    within, whole, packages = _engine_names()
    out: list[tuple[str, int, str]] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "models":
            continue
        tree = ast.parse(path.read_text())
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                hits = sorted(x for x in within if x in n.value) + sorted(x for x in whole if n.value == x)
                out += [(str(rel), n.lineno, repr(h)) for h in hits]
            modules = []
            if isinstance(n, ast.ImportFrom) and n.module:
                modules = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            elif isinstance(n, ast.Import):
                modules = [a.name for a in n.names]
            family_modules = [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]
            if family_modules:  # one line per import statement
                out.append((str(rel), n.lineno, f"imports {family_modules[0]}"))
    return [f"{path}:{line}: {what}" for path, line, what in sorted(out)]


def test_no_module_outside_models_names_an_architecture():
    found = architecture_names_in_code()
    assert not found, "architecture names outside gspo_megatron/models/ (ask the family instead):\n" + "\n".join(found)


def test_the_scan_sees_a_name(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "ok.py").write_text('X = "Qwen3MoeForCausalLM"\n')
    (tmp_path / "a.py").write_text(
        '"""Qwen3MoeForCausalLM in a docstring is fine."""\n'
        'T = {"Qwen3MoeTopKRouter": 1}\n'
        'if mt == "qwen3_moe":\n    pass\n'
        "from gspo_megatron.models.qwen3_5_moe import LM_PREFIX\n"
        "from gspo_megatron.models import qwen3_moe\n"
    )
    assert architecture_names_in_code(tmp_path) == [
        "a.py:2: 'Qwen3MoeTopKRouter'",
        "a.py:3: 'qwen3_moe'",
        "a.py:5: imports gspo_megatron.models.qwen3_5_moe",
        "a.py:6: imports gspo_megatron.models.qwen3_moe",
    ]
