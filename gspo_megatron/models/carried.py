"""Tensors of published checkpoints carried through unchanged: the multi-token-prediction (MTP) layers,
and the prefixes a family declares (``Family.carried_prefixes``: the vision tower of Qwen3.5-MoE's
conditional-generation checkpoint). What follows says "MTP"; the carried prefixes take the same path.

DeepSeek-V3 / R1 / V3.2, GLM-4.5 / GLM-5 (``num_nextn_predict_layers``) and MiniMax-M2
(``num_mtp_modules``) ship M extra layers after the N decoder layers, named
``model.layers.<i>.*`` with N <= i < N + M (Qwen3-Next / Qwen3.5: ``mtp.*``, ``mtp_num_hidden_layers``) (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.*``,
``embed_tokens`` and a whole decoder layer; block-FP8 ``weight_scale_inv`` tensors included).
transformers 5.23 ignores them on load; sglang 0.5.23 serves them as a separate draft model for
speculative decoding (``models/deepseek_nextn.py``, ``glm4_moe_nextn.py``), read from the checkpoint
directory at start-up, and its target model's ``load_weights`` skips them
(``models/deepseek_common/deepseek_weight_loader.py``: layers >= ``num_hidden_layers`` ``continue`` when
not ``is_nextn``; ``models/minimax_m2.py`` ``get_spec_layer_idx_from_weight_name``). So:

- without ``model.mtp`` (and for every family whose MTP layer is not built into the Megatron model:
  ``ModelFamily.mtp_trainable``) they are not trained and the weight sync never sends them (the export
  stream holds the Megatron model's tensors only: ``models/weights.py``); the engines keep the published
  ones. With ``model.mtp`` (GLM-4.5, DeepSeek-V3, Qwen3-Next) the Megatron model holds the MTP layer
  (``models/mtp.py``): it is trained, sent by the weight sync under its HF names (the engines' draft
  loads them) and exported from the model; of the MTP layer only its ``embed_tokens`` /
  ``shared_head.head`` (:data:`MTP_SHARED`: sglang's draft skips them and shares the target's, as
  megatron's MTP shares the model's) stay carried. Block-FP8 checkpoints are not dequantized on load,
  for the decoder layers as for the MTP layer; with ``model.mtp`` the layer's ``weight_scale_inv`` is
  left out of the export with the weights it scaled (:class:`CarriedTensors` ``mtp_trained``);
- conversion and every checkpoint keep them beside the Megatron checkpoint, unchanged (same bytes,
  same dtype): ``<checkpoint>/hf_assets/carried.safetensors``, written where the tokenizer files are
  copied (``checkpoint.manager._copy_hf_assets``). Stored rather than re-read from the source HF
  directory at export so that a checkpoint stays complete on its own (the source may be gone or
  changed by then); the cost is the MTP layer once per checkpoint (DeepSeek-V3: about 1% of the
  bf16 weights, less than 0.3% of a checkpoint with its optimizer state);
- export (``convert.export_to_hf_dir``) writes them into the HF directory's safetensors shards (and
  index) next to the trained tensors, from ``carried.safetensors`` or, for the trainer's final export
  whose assets directory is the source HF directory itself, from that directory's shards.
"""

from __future__ import annotations

import os
import re

import torch

from gspo_megatron.models import hf_config
from gspo_megatron.models.mtp_naming import MTP_BRANCH

CARRIED_FILE = "carried.safetensors"
COUNT_FIELDS = ("num_nextn_predict_layers", "num_mtp_modules", "mtp_num_hidden_layers")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# the MTP layer's copies of the target's embedding and head (``model.layers.{N}.<name>``): carried even with
# ``model.mtp`` (sglang's draft skips them and shares the target's; megatron's MTP shares the model's)
MTP_SHARED = (".embed_tokens.weight", ".shared_head.head.weight")


def mtp_layers(hf: dict) -> int:
    """M, the number of MTP layers the config declares (0 when none)."""
    return max(int(hf_config.get(hf, f, 0) or 0) for f in COUNT_FIELDS)


def mtp_names(hf: dict, names) -> list[str]:
    """The names among ``names`` of the MTP layers: ``model.layers.<i>.*``, N <= i < N + M, and
    ``mtp.*`` (Qwen3-Next / Qwen3.5, ``mtp_num_hidden_layers``) (sorted)."""
    m = mtp_layers(hf)
    if not m:
        return []
    n = hf_config.get_int(hf, "num_hidden_layers")
    out = []
    for name in names:
        match = _LAYER.match(name)
        if match and n <= int(match.group(1)) < n + m or name.startswith(MTP_BRANCH.branch):
            out.append(name)
    return sorted(out)


def carried_prefixes(hf: dict) -> tuple[str, ...]:
    """The family's other carried tensors' name prefixes (``ModelFamily.carried_prefixes``: the vision
    tower of a vision-language checkpoint, ``model.visual.``)."""
    from gspo_megatron.models.registry import family_for_model_type

    family = family_for_model_type(hf.get("model_type"))
    return tuple(family.carried_prefixes(hf)) if family is not None else ()


def carried_names(hf: dict, names) -> list[str]:
    """Every tensor among ``names`` carried through unchanged: the MTP layers (:func:`mtp_names`) and
    the family's ``carried_prefixes`` (a vision tower) (sorted). One mechanism keeps them all."""
    prefixes = carried_prefixes(hf)
    extra = [n for n in names if prefixes and n.startswith(prefixes)]
    return sorted(set(mtp_names(hf, names)) | set(extra))


class CarriedTensors:
    """The carried tensors (:func:`carried_names`: MTP layers, a vision tower) a directory holds:
    ``carried.safetensors`` (a checkpoint's ``hf_assets``: the MTP layers and the family's carried prefixes) or,
    for an HF model directory, its own shards. ``entries()``: (name, shape, dtype) sorted by name;
    ``get(name)``: the tensor as stored. ``exclude``: names left out (the export's own). ``mtp_trained``: the
    model holds its MTP layer (``model.mtp``) and exports it trained, so of the MTP layers only
    :data:`MTP_SHARED` stay carried (a block-FP8 checkpoint's ``weight_scale_inv`` of the layer is left out
    with the weights it scaled)."""

    def __init__(
        self,
        directory: str | None,
        hf: dict,
        exclude: set[str] | frozenset[str] = frozenset(),
        mtp_trained: bool = False,
    ):
        from safetensors import safe_open

        from gspo_megatron.models.safetensors_reader import SafetensorsReader

        self._file = self._reader = None
        self.names: list[str] = []
        if not directory or not os.path.isdir(directory) or not (mtp_layers(hf) or carried_prefixes(hf)):
            return
        path = os.path.join(directory, CARRIED_FILE)
        if os.path.isfile(path):
            self._file = safe_open(path, "pt")
            self.names = sorted(n for n in self._file.keys() if n not in exclude)
        elif any(
            os.path.isfile(os.path.join(directory, f)) for f in ("model.safetensors", "model.safetensors.index.json")
        ):
            self._reader = SafetensorsReader(directory)
            self.names = [n for n in carried_names(hf, self._reader.names()) if n not in exclude]
        if mtp_trained:
            mtp = set(mtp_names(hf, self.names))
            self.names = [n for n in self.names if n not in mtp or n.endswith(MTP_SHARED)]

    def get(self, name: str) -> torch.Tensor:
        if self._file is not None:
            return self._file.get_tensor(name)
        if self._reader is None:  # neither source: ``names`` is empty
            raise KeyError(f"{name!r} is not a carried tensor here (none found)")
        return self._reader.get(name)

    def entries(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        out = []
        for name in self.names:
            if self._file is not None:
                s = self._file.get_slice(name)
                out.append((name, tuple(s.get_shape()), _DTYPES[s.get_dtype()]))
            else:
                t = self.get(name)
                out.append((name, tuple(t.shape), t.dtype))
        return out

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._file = self._reader = None


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def save_carried(hf_dir: str, out_dir: str) -> bool:
    """Write the MTP tensors of the HF directory ``hf_dir`` unchanged into ``out_dir/carried.safetensors``.
    Returns whether there were any (none: no file). Holds the MTP tensors in memory once (views of
    the memory-mapped source until ``save_file`` writes them)."""
    from safetensors.torch import save_file

    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        return False
    src = CarriedTensors(hf_dir, hf_config.load_hf_config(hf_dir))
    try:
        if not src.names:
            return False
        os.makedirs(out_dir, exist_ok=True)
        save_file(
            {n: src.get(n).contiguous() for n in src.names},
            os.path.join(out_dir, CARRIED_FILE),
            metadata={"format": "pt"},
        )
        return True
    finally:
        src.close()
