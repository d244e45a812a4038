"""Load a :class:`~gspo_megatron.config.schema.Config` from YAML + dotted overrides, save it, print its help.

Every rank calls :func:`load_config` (cheap, no collectives): it coerces each value to its field's
type (errors name ``section.key``), fills the automatic values and runs the static checks of
:mod:`gspo_megatron.config.validation`.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import TYPE_CHECKING, Any, Literal

import yaml

from gspo_megatron.config.schema import Config
from gspo_megatron.config.validation import _static_errors
from gspo_megatron.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _field_type(cls: type[DataclassInstance], key: str) -> Any:
    """The type the loader checks for ``cls.key``: its annotation, or a Literal of the values its
    ``choices`` registry holds now (``schema._f(..., choices=...)``: gspo.mode, rollout.sync_mode)."""
    f = cls.__dataclass_fields__.get(key)
    choices = f.metadata.get("choices") if f is not None else None
    return Literal[tuple(choices())] if choices else _hints(cls)[key]


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "|".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert a YAML value to the field's type or raise ConfigError naming the field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name)  # our unions are always `X | None`
    bad = ConfigError(f"{name} must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value is False and "off" in args:  # YAML 1.1 reads a bare `off` as false
            return "off"
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{name} must be one of {', '.join(repr(a) for a in args)}; got {value!r}{hint}")
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise bad
        return [_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is bool and isinstance(value, bool):
        return value
    if (
        tp is int
        and not isinstance(value, bool)
        and (isinstance(value, int) or isinstance(value, float) and value.is_integer())
    ):
        return int(value)
    if tp is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)  # a str too: YAML 1.1 reads "1e-6" (no dot) as a string
        except ValueError:
            pass
    if tp is str and not isinstance(value, (bool, list, dict, type(None))):
        return str(value)  # numbers and dates read by YAML from a path-like value
    if tp in (bool, int, float, str):
        raise bad
    raise TypeError(f"unsupported field type {tp!r} for {name}")  # a bug in this module


def _did_you_mean(key: str, options: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.6)
    return f"unknown key '{prefix}{key}'" + (
        f"; did you mean '{prefix}{close[0]}'?" if close else f"; allowed keys: {', '.join(options)}"
    )


def _apply(obj: Any, data: dict[str, Any], prefix: str, errors: list[str]) -> None:
    """Set fields of the dataclass ``obj`` from a (nested) dict, collecting errors."""
    hints = _hints(type(obj))
    for key, value in data.items():
        key = str(key)
        if key not in hints:
            errors.append(_did_you_mean(key, list(hints), prefix))
            continue
        tp, name = _field_type(type(obj), key), prefix + key
        if _is_section(tp):
            if not isinstance(value, dict):
                errors.append(f"{name} must be a mapping of its keys, got {value!r}")
            else:
                _apply(getattr(obj, key), value, name + ".", errors)
            continue
        try:
            setattr(obj, key, _coerce(value, tp, name))
        except ConfigError as e:
            errors.extend(e.errors)


def _override_to_dict(item: str) -> dict[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. rollout.group_size=16)")
    path, raw = item.split("=", 1)
    path = path.strip().lstrip("-")
    if not path or any(not p for p in path.split(".")):
        raise ConfigError(f"override {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e.__class__.__name__})") from None
    out: dict[str, Any] = {}
    node = out
    parts = path.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


def load_config(path: str | None, overrides: list[str] | None = None, *, check_files: bool = True) -> Config:
    """Load ``path`` (YAML; None = defaults), apply ``overrides`` (``a.b=value``, value parsed as
    YAML), resolve automatic values and validate. ``check_files=False`` skips checks that files exist
    (the planner plans recipes whose paths are placeholders). Raises ConfigError."""
    cfg = Config()
    errors: list[str] = []
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        with open(path) as fh:
            try:
                data = yaml.safe_load(fh)
            except yaml.YAMLError as e:
                raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections, got {type(data).__name__}")
        file_errors: list[str] = []
        _apply(cfg, data, "", file_errors)
        errors += [f"{path}: {e}" for e in file_errors]
    for item in overrides or []:
        try:
            _apply(cfg, _override_to_dict(item), "", errors)
        except ConfigError as e:
            errors.extend(e.errors)
    if errors:
        raise ConfigError(errors)
    _resolve(cfg)
    errors = _static_errors(cfg, check_files)
    if errors:
        raise ConfigError(errors)
    return cfg


def save_config(cfg: Config, path: str, header: str | None = None) -> None:
    """Write the resolved config as YAML (loadable by :func:`load_config`), ``header`` as a leading
    comment; rank 0 calls it."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        if header:
            fh.write("".join(f"# {line}\n" for line in header.splitlines()))
        yaml.safe_dump(cfg.to_dict(), fh, sort_keys=False, default_flow_style=False)
    os.replace(tmp, path)


def config_help() -> str:
    """Every field as ``section.key: type = default`` and its one-line description."""
    lines = ["Config fields (YAML sections; override any as section.key=value):"]

    def walk(cls: type[DataclassInstance], prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = _field_type(cls, f.name)
            if _is_section(tp):
                lines.append(f"\n[{prefix}{f.name}]")
                walk(tp, f"{prefix}{f.name}.")
                continue
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                assert f.default_factory is not dataclasses.MISSING  # every schema field has a default
                default = f.default_factory()
            lines.append(
                f"  {prefix}{f.name}: {_type_name(tp)} = {yaml.safe_dump(default, default_flow_style=True).strip().removesuffix('...').strip()}"
            )
            lines.append(f"      {f.metadata.get('help', '')}")

    walk(Config, "")
    return "\n".join(lines)


def _resolve(cfg: Config) -> None:
    """Fill the automatic values (written as null in YAML) so the saved config shows what ran."""
    from gspo_megatron.losses.objectives import policy_objective

    low, high = policy_objective(cfg.gspo.mode, "gspo.mode").default_clip
    if cfg.gspo.clip_low is None:
        cfg.gspo.clip_low = low
    if cfg.gspo.clip_high is None:
        cfg.gspo.clip_high = high
    p = cfg.parallel
    if p.etp is None:
        p.etp = p.tp
    if p.sequence_parallel is None or p.tp == 1:  # Megatron disables SP without TP
        p.sequence_parallel = p.tp > 1
