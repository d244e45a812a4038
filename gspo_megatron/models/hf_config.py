"""Every spelling of an HF ``config.json`` field that transformers 4.x and 5.x write, read in one place.

The trainer, the planner, the conversion tools and the families read config fields only through
these functions, on the ``config.json`` dict as it came, except that a vision-language config's
``text_config`` fields are lifted to the top level (``lift_text_config``, undone by ``file_config`` when
a config.json is written).
Spellings handled (first present wins):

- experts: ``num_experts`` (Qwen-MoE, 4.x and 5.x), ``num_local_experts`` (Mixtral; Qwen3-MoE as
  transformers 5.x saves it), ``n_routed_experts`` (DeepSeek / GLM-MoE);
- RoPE: 4.x writes ``rope_theta`` at the top level and an optional ``rope_scaling`` dict (``type`` or
  ``rope_type``); 5.x writes one ``rope_parameters`` dict holding ``rope_type``, ``rope_theta`` and
  the scaling keys (``factor``, ``original_max_position_embeddings``, ...). ``rope_parameters(hf)``
  merges them into one dict whose ``rope_type`` is always set ("default" when unscaled);
- ``partial_rotary_factor`` at the top level (4.x) or inside ``rope_parameters`` (5.x); without one,
  a legacy ``rotary_dim`` (MiniMax-M2's published config.json) means ``rotary_dim / head_dim``, as
  transformers' ``MiniMaxM2Config.convert_rope_params_to_dict`` reads it;
- ``head_dim`` absent or null -> hidden_size / num_attention_heads; ``num_key_value_heads`` absent
  or null -> num_attention_heads.
(The checkpoint dtype, ``torch_dtype`` (4.x) or ``dtype`` (5.x), is read by ``convert.hf_dtype``.)
"""

from __future__ import annotations

import json
import os


class HFConfigError(ValueError):
    """config.json lacks a field or holds a value the code cannot use (the message names it)."""


_MISSING = object()

#: canonical name -> the spellings transformers writes, in lookup order
SPELLINGS: dict[str, tuple[str, ...]] = {
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
}


def load_hf_config(path: str) -> dict:
    """config.json of an HF directory (or the file itself) as a dict; clear errors on bad input."""
    cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json at {cfg_path}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path}: expected a JSON object, got {type(cfg).__name__}")
    return lift_text_config(cfg)


def architecture_of(path: str) -> str | None:
    """``architectures[0]`` of the config.json at ``path`` (an HF directory); None when there is none or it
    cannot be read (the caller's own load says why)."""
    try:
        return (load_hf_config(path).get("architectures") or [None])[0]
    except (OSError, ValueError):
        return None


#: key of a lifted config (``lift_text_config``): the names lifted from ``text_config`` to the top level
LIFTED = "_lifted_from_text_config"


def lift_text_config(cfg: dict) -> dict:
    """A vision-language config.json (``text_config`` beside ``vision_config``, e.g.
    ``Qwen3_5MoeForConditionalGeneration``) as the code reads it: the language model's fields
    (``text_config``'s keys the top level lacks) lifted to the top level, their names listed under
    :data:`LIFTED` so that :func:`file_config` gives back the file's dict (export writes that). The top
    level keeps ``model_type``, ``architectures``, ``tie_word_embeddings``, ``dtype``. A config
    without a ``text_config`` dict, or one already lifted, is returned unchanged."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or LIFTED in cfg:
        return cfg
    lifted = sorted(k for k in text if k not in cfg)
    return {**cfg, **{k: text[k] for k in lifted}, LIFTED: lifted}


def file_config(cfg: dict) -> dict:
    """The config.json dict of ``cfg`` (the inverse of :func:`lift_text_config`)."""
    if LIFTED not in cfg:
        return cfg
    drop = set(cfg[LIFTED]) | {LIFTED}
    return {k: v for k, v in cfg.items() if k not in drop}


def _what(hf: dict) -> str:
    return f"config.json of model_type {hf.get('model_type', '?')}"


def get(hf: dict, name: str, default=_MISSING):
    """The value of canonical field ``name`` under any of its spellings (``SPELLINGS``; a name not
    listed is its own only spelling). A null value counts as absent. Without ``default`` a missing
    field raises HFConfigError naming every spelling."""
    keys = SPELLINGS.get(name, (name,))
    for k in keys:
        if hf.get(k) is not None:
            return hf[k]
    if default is _MISSING:
        names = " (or ".join(repr(k) for k in keys) + ")" * (len(keys) - 1)
        raise HFConfigError(f"{_what(hf)} lacks {names}")
    return default


def get_int(hf: dict, name: str, default=_MISSING) -> int:
    v = get(hf, name, default)
    try:
        return int(v)
    except (TypeError, ValueError):
        raise HFConfigError(f"{_what(hf)}: {name} must be an integer, got {v!r}") from None


def num_experts(hf: dict) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    return get_int(hf, "num_experts", 0)


def num_heads(hf: dict) -> int:
    return get_int(hf, "num_attention_heads")


def num_kv_heads(hf: dict) -> int:
    return get_int(hf, "num_key_value_heads", num_heads(hf))


def head_dim(hf: dict) -> int:
    if hf.get("head_dim") is not None:
        return int(hf["head_dim"])
    return get_int(hf, "hidden_size") // num_heads(hf)


def rope_parameters(hf: dict) -> dict:
    """One flat dict: ``rope_type`` (always set), ``rope_theta`` (default 10000) and the scaling keys,
    from 5.x ``rope_parameters`` or 4.x ``rope_scaling`` + top-level ``rope_theta`` /
    ``partial_rotary_factor``. Per-layer-type nested parameters (a dict of dicts) are refused."""
    out: dict = {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if hf.get(key) is not None:
            out[key] = hf[key]
    for key in ("rope_scaling", "rope_parameters"):  # 5.x's dict wins over 4.x's
        d = hf.get(key)
        if d is None:
            continue
        if not isinstance(d, dict):
            raise HFConfigError(f"{_what(hf)}: {key} must be a JSON object, got {d!r}")
        if any(isinstance(v, dict) for v in d.values()):
            raise HFConfigError(f"{_what(hf)}: {key} nested per layer type ({', '.join(d)}) is not supported")
        out.update(d)
    if out.get("partial_rotary_factor") is None and hf.get("rotary_dim") is not None:
        out["partial_rotary_factor"] = int(hf["rotary_dim"]) / head_dim(hf)
    kind = out.pop("type", None)
    out["rope_type"] = out.get("rope_type") or kind or "default"
    out["rope_theta"] = float(out.get("rope_theta", 10000.0))
    return out


def rope_theta(hf: dict) -> float:
    return rope_parameters(hf)["rope_theta"]


def rope_type(hf: dict) -> str:
    return rope_parameters(hf)["rope_type"]


def partial_rotary_factor(hf: dict) -> float:
    return float(rope_parameters(hf).get("partial_rotary_factor", 1.0))
