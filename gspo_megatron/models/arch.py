"""The built-in architecture table and where a config's model dims come from.

``KNOWN_ARCHS``: each family's published config.json dicts by short name (``model.arch``).
:func:`model_hf_config` picks a config's HF config.json: ``model.hf_path``/config.json, else
``model.arch``, else the architecture detected from ``model.hf_path``'s name. Used by the config
checks, the planner, preflight and the factory; imports no config module (no cycle).
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from gspo_megatron.errors import ConfigError

if TYPE_CHECKING:
    from gspo_megatron.config.schema import Config


def _known_archs() -> dict[str, dict]:
    from gspo_megatron.models.registry import published_configs

    return published_configs()


#: built-in config.json dicts by short name (each family's ``published`` configs)
KNOWN_ARCHS: dict[str, dict] = _known_archs()


def supported_model_types() -> list[str]:
    from gspo_megatron.models.registry import supported_model_types as types

    return types()


def _norm_name(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def detect_arch(path: str) -> str | None:
    """The built-in architecture whose name appears in ``path``'s last component (case, '-', '_'
    and '.' ignored), e.g. ``/models/Qwen3-30B-A3B-Instruct-2507`` -> ``qwen3-30b-a3b``."""
    base = _norm_name(os.path.basename(os.path.normpath(path)))
    for name in sorted(KNOWN_ARCHS, key=len, reverse=True):
        if _norm_name(name) in base:
            return name
    return None


def model_hf_config(cfg: Config) -> tuple[dict, str]:
    """The model's HF config.json as a dict, and where it came from. Order: model.hf_path/config.json
    if it exists; else model.arch; else the architecture detected from model.hf_path's name."""
    from gspo_megatron.models.hf_config import load_hf_config

    m = cfg.model
    if m.hf_path and os.path.isfile(os.path.join(m.hf_path, "config.json")):
        path = os.path.join(m.hf_path, "config.json")
        try:
            return load_hf_config(path), path
        except ValueError as e:
            raise ConfigError(f"model.hf_path: {e}") from None
    if m.arch:
        if m.arch not in KNOWN_ARCHS:
            raise ConfigError(f"model.arch {m.arch!r} is not built in; known: {', '.join(KNOWN_ARCHS)}")
        return dict(KNOWN_ARCHS[m.arch]), f"built-in table ({m.arch})"
    if m.hf_path and (name := detect_arch(m.hf_path)):
        return dict(KNOWN_ARCHS[name]), f"built-in table ({name}, detected from model.hf_path's name)"
    raise ConfigError(
        f"model.hf_path {m.hf_path!r} has no config.json and its name matches no built-in "
        f"architecture; set model.arch to one of {', '.join(KNOWN_ARCHS)}"
    )
