"""Where a checkpoint keeps its multi-token-prediction (MTP) layer (``MTPNaming``), for the families to
declare (``ModelFamily.mtp_naming``) and ``models/mtp.py`` to read: a module of its own, importing nothing of
the package, so that the family base class can name it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MTPNaming:
    """Where a checkpoint keeps its MTP layer (``models/mtp.py``: Names). Each pattern's ``{i}`` is the
    layer's HF index: N + k (``after_decoder``: the layer continues ``model.layers``) or k.

    layer: the prefix of the layer's decoder-layer tensors; enorm / hnorm / eh_proj / final_norm: its own
    four tensors (megatron's ``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm``); shared: the suffixes,
    under ``layer``, of the layer's copies of the target's embedding and head (carried, never loaded);
    count_field: the config.json field declaring the layer count; loader: the sglang file that loads it;
    branch: the top-level module every name of the layer lives under when the layer is a branch of its
    own (``mtp.``; sglang loads it into a separate draft model), else empty."""

    layer: str
    enorm: str
    hnorm: str
    eh_proj: str
    final_norm: str
    shared: tuple[str, ...]
    after_decoder: bool
    count_field: str
    loader: str
    branch: str = ""

    def index(self, hf: dict, k: int = 0) -> int:
        """The HF index of MTP layer k (0-based)."""
        return int(hf["num_hidden_layers"]) + k if self.after_decoder else k

    def prefix(self, hf: dict, k: int = 0) -> str:
        """The HF prefix of MTP layer k's decoder-layer tensors, e.g. ``model.layers.4.`` / ``mtp.layers.0.``."""
        return self.layer.format(i=self.index(hf, k))

    def own_patterns(self) -> dict[str, str]:
        """megatron's name of each own tensor (under ``mtp.layers.{k}.``) -> its HF name pattern."""
        names = (self.enorm, self.hnorm, self.eh_proj, self.final_norm)
        return dict(zip(("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"), names))

    def own(self, hf: dict, k: int = 0) -> dict[str, str]:
        """megatron's name of each own tensor (under ``mtp.layers.{k}.``) -> its HF name."""
        return {key: name.format(i=self.index(hf, k)) for key, name in self.own_patterns().items()}

    def shared_names(self, hf: dict, k: int = 0) -> tuple[str, ...]:
        """The HF names of MTP layer k's carried copies of the embedding and head."""
        return tuple(self.prefix(hf, k) + s for s in self.shared)


AFTER_DECODER = MTPNaming(
    layer="model.layers.{i}.",
    enorm="model.layers.{i}.enorm.weight",
    hnorm="model.layers.{i}.hnorm.weight",
    eh_proj="model.layers.{i}.eh_proj.weight",
    final_norm="model.layers.{i}.shared_head.norm.weight",
    shared=("embed_tokens.weight", "shared_head.head.weight"),
    after_decoder=True,
    count_field="num_nextn_predict_layers",
    loader="srt/models/deepseek_common/deepseek_weight_loader.py",
)
MTP_BRANCH = MTPNaming(
    layer="mtp.layers.{i}.",
    enorm="mtp.pre_fc_norm_embedding.weight",
    hnorm="mtp.pre_fc_norm_hidden.weight",
    eh_proj="mtp.fc.weight",
    final_norm="mtp.norm.weight",
    shared=(),
    after_decoder=False,
    count_field="mtp_num_hidden_layers",
    loader="srt/models/qwen3_next_mtp.py",
    branch="mtp.",
)
