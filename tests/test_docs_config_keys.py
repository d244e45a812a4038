"""Every config key the docs and README name (``section.key``, e.g. ``rollout.engine_urls``) exists in
the config schema (issue 21: docs/gpu.md named ``rollout.sglang.urls``, which no config has).

A ``section.name`` that is not a config key is accepted only when it names something else that exists:
a module file (``train.py``), a module (``orchestration.batch``), a function or attribute of a module
(``train.run_step``, ``checkpoint.manager.save_checkpoint``), a file name (``model.safetensors``), or one of
the few outside names listed in OTHER_NAMES."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

from gspo_megatron.config.schema import Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# transformers' model.generate (docs/bench.md); Megatron's megatron.core.dist_checkpointing...
# checkpoint._in_process_results_queue (docs/conversion.md)
OTHER_NAMES = {"model.generate", "checkpoint._in_process_results_queue"}
FILE_SUFFIXES = (".py", ".safetensors", ".json", ".yaml", ".jsonl", ".md")


def _sections() -> dict[str, object]:
    cfg = Config()
    return {
        f.name: getattr(cfg, f.name)
        for f in dataclasses.fields(Config)
        if dataclasses.is_dataclass(getattr(cfg, f.name))
    }


def _is_other_name(token: str, section: str, rest: str) -> bool:
    if token in OTHER_NAMES or token.endswith(FILE_SUFFIXES):
        return True
    if section == "model" and rest.split(".")[0] in ("layers", "embed_tokens", "norm", "visual", "language_model"):
        return True  # a Hugging Face tensor name (model.layers.2.self_attn...), not a config key
    parts = [section] + rest.split(".")
    for k in range(len(parts), 0, -1):  # the longest importable module prefix, then its attributes
        try:
            obj = importlib.import_module("gspo_megatron." + ".".join(parts[:k]))
        except ImportError:
            continue
        if k == len(parts):
            return True  # a module (orchestration.batch)
        return hasattr(obj, parts[k])  # a function or attribute of it (orchestration.batch.collect_rollouts)
    return False


def test_docs_name_only_config_keys_that_exist():
    sections = _sections()
    pattern = re.compile(
        r"(?<![\w./-])(" + "|".join(sorted(sections, key=len, reverse=True)) + r")\.([A-Za-z_][\w]*(?:\.[\w]+)*)"
    )
    wrong = []
    for path in DOCS:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for m in pattern.finditer(line):
                section, rest = m.group(1), m.group(2)
                key = rest.split(".")[0]
                if "." not in rest and hasattr(sections[section], key):
                    continue
                sub = getattr(sections[section], key, None)  # a nested section: model.lora.rank
                if dataclasses.is_dataclass(sub) and rest.count(".") == 1 and hasattr(sub, rest.split(".")[1]):
                    continue
                if not _is_other_name(m.group(0), section, rest):
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert not wrong, "config keys the schema does not have:\n" + "\n".join(wrong)
