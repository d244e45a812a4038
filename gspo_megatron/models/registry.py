"""The family registry. Families register with ``@register_family`` (each family folder's
``__init__.py``); ``gspo_megatron/models/__init__.py`` imports every family folder, so importing
anything under ``gspo_megatron.models`` fills the registry first. This module imports no family.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from gspo_megatron.models.family import ModelFamily
    from gspo_megatron.models.rules import ExpertNaming, StackedExpertNaming

_BY_TYPE: dict[str, "ModelFamily"] = {}
_BY_ARCH: dict[str, "ModelFamily"] = {}


class UnsupportedModelError(ValueError):
    """config.json names an architecture no family accepts (the message lists the supported ones)."""


def register_family(cls):
    """Class decorator: instantiate a ``ModelFamily`` subclass and register it under its
    ``model_types`` and ``architectures``. Returns the class unchanged."""
    family = cls()
    for mt in family.model_types:
        if mt in _BY_TYPE:
            raise ValueError(f"model_type {mt!r} registered twice ({_BY_TYPE[mt].name}, {family.name})")
        _BY_TYPE[mt] = family
    for arch in family.architectures:
        _BY_ARCH[arch] = family
    cls.instance = family
    _NAMINGS.clear()
    return cls


def families() -> Iterator["ModelFamily"]:
    """Every registered family, once each, in registration order."""
    seen = []
    for f in _BY_TYPE.values():
        if f not in seen:
            seen.append(f)
    return iter(seen)


def supported_model_types() -> list[str]:
    return sorted(_BY_TYPE)


def family_for_model_type(model_type: str | None) -> "ModelFamily | None":
    return None if model_type is None else _BY_TYPE.get(model_type)


def get_family(hf: dict) -> "ModelFamily":
    """The family for config.json's ``model_type`` (or, without one, its ``architectures``).
    Raises UnsupportedModelError naming the model_type and the supported ones."""
    mt = hf.get("model_type")
    if mt in _BY_TYPE:
        return _BY_TYPE[mt]
    if mt is None:
        for arch in hf.get("architectures") or []:
            if arch in _BY_ARCH:
                return _BY_ARCH[arch]
    archs = f" (architectures {hf['architectures']!r})" if hf.get("architectures") else ""
    raise UnsupportedModelError(
        f"unsupported architecture: config.json model_type {mt!r}{archs} is not "
        f"supported; supported model_types: {', '.join(supported_model_types())}"
    )


def expert_naming(model_type: str | None):
    """The checkpoint naming of routed experts for ``model_type`` (None: no family or no experts)."""
    f = family_for_model_type(model_type)
    return None if f is None else f.expert_naming


def experts_stacked(model_type: str | None) -> bool:
    """Whether ``model_type``'s checkpoints keep routed experts stacked per layer under the names
    transformers holds in memory (gpt-oss), so they load by name."""
    f = family_for_model_type(model_type)
    return bool(f is not None and f.experts_stacked_in_checkpoint)


def expert_weight(name: str) -> tuple[int, str] | None:
    """(expert, ``"gate" | "up" | "down"``) when checkpoint tensor ``name`` is one routed expert's
    weight under some family's ``expert_naming`` (``ExpertNaming.weight_of``), else None."""
    for naming in _namings()[0]:
        found = naming.weight_of(name)
        if found is not None:
            return found
    return None


def stacked_expert_naming(name: str) -> "StackedExpertNaming | None":
    """The ``stacked_expert_naming`` of the family whose checkpoints hold ``name`` as a stacked expert
    tensor (gpt-oss's ``mlp.experts.gate_up_proj``, ...), else None."""
    for naming in _namings()[1]:
        if naming.tensor_of(name) is not None:
            return naming
    return None


def _namings() -> tuple[list["ExpertNaming"], list["StackedExpertNaming"]]:
    """The distinct ``expert_naming`` and ``stacked_expert_naming`` of the registered families, in
    registration order (cached; ``register_family`` empties the cache)."""
    if not _NAMINGS:
        experts: list[ExpertNaming] = []
        stacked: list[StackedExpertNaming] = []
        for f in families():
            if f.expert_naming is not None and f.expert_naming not in experts:
                experts.append(f.expert_naming)
            if f.stacked_expert_naming is not None and f.stacked_expert_naming not in stacked:
                stacked.append(f.stacked_expert_naming)
        _NAMINGS.append((experts, stacked))
    return _NAMINGS[0]


_NAMINGS: list[tuple[list["ExpertNaming"], list["StackedExpertNaming"]]] = []  # _namings()'s cache


def fp8_quantizes(name: str) -> bool:
    """True when some family quantizes the HF tensor ``name`` on an FP8 weight sync
    (``ModelFamily.fp8_quantizes``)."""
    return any(f.fp8_quantizes(name) for f in families())


def published_configs() -> dict[str, dict]:
    """Built-in config.json dicts of published checkpoints (and the CPU demo), by short name."""
    out: dict[str, dict] = {}
    for f in families():
        out.update(f.published)
    return out
