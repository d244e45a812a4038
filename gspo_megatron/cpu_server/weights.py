"""One TP rank's weights: the shard of every HF-named tensor that SGLang would put on that rank.

:class:`ShardStore` knows every checkpoint name of the model and its full shape (from a
meta-device transformers model, through ``engines.hf_engine.HFCheckpointLayout``, so per-expert
names follow the checkpoint layout of each family), loads tensors by name the way sglang's
``load_weights`` does (skip rules below), and keeps only this rank's shard (``sharding``).

Load rules copied from sglang 0.5.23's ``models/{qwen2,qwen3,qwen3_moe,mixtral}.py::load_weights``:
a name the model does not have is skipped silently (``if name not in params_dict: continue``), as
are ``rotary_emb.inv_freq`` and, with tied embeddings, ``lm_head.weight``; an expert of another EP
rank is skipped; a shape that does not match raises (sglang's weight loaders assert it).

A vision-language checkpoint (Qwen3.5-MoE's ``Qwen3_5MoeForConditionalGeneration``) is stored as its
language model under the checkpoint's names (``model.language_model.*``, ``lm_head.weight``;
``engines.hf_engine.language_model_of``). Names as sglang 0.5.23's
``Qwen3_5MoeForConditionalGeneration.load_weights`` (``models/qwen3_5.py``) takes them: ``model.X``
is the same tensor as ``model.language_model.X`` (sglang rewrites ``model.language_model.`` ->
``model.``), names containing ``mtp`` are skipped, and the vision tower (``model.visual.*``: sglang loads it
into its vision tower, which text generation never runs) is not held here: skipped.
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from gspo_megatron.cpu_server.sharding import Layout, shard_for_rank
from gspo_megatron.dtypes import torch_dtype
from gspo_megatron.engines.hf_engine import (
    HFCheckpointLayout,
    checkpoint_name,
    language_model_of,
    outside_language_model,
)


def resolve_dtype(flag: str, config: PretrainedConfig) -> torch.dtype:
    """``--dtype auto`` -> the config's dtype (float32 when it has none), as sglang does
    (sglang turns float32 checkpoints into bfloat16 on GPU; on CPU float32 stays float32)."""
    if flag != "auto":
        return torch_dtype(flag)
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        try:
            d = torch_dtype(d)
        except ValueError:  # e.g. "auto": float32, as before
            d = None
    return d if isinstance(d, torch.dtype) else torch.float32


def checkpoint_shapes(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint-layout name of the model -> its full shape (no memory allocated); of a
    vision-language checkpoint, its language model's (``hf_engine.language_model_of``)."""
    lm_config, prefix = language_model_of(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(lm_config)
    layout = HFCheckpointLayout(model, prefix)
    return {n: tuple(layout.target(n).shape) for n in layout.checkpoint_names()}


def iter_checkpoint(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the model directory's safetensors files (sharded
    checkpoints through ``model.safetensors.index.json``)."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_path, x) for x in files]
    else:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"--model-path {model_path}: no *.safetensors files (use --load-format dummy to start with random weights)"
        )
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def dummy_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random init for ``--load-format dummy``: the same on every rank (seeded by name and seed)."""
    g = torch.Generator().manual_seed((zlib.crc32(name.encode()) + 7919 * seed) % (2**31))
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    return torch.randn(shape, generator=g) * 0.02


class ShardStore:
    """The shards one engine TP rank holds, by HF checkpoint name.

    shards[name]: this rank's part (see ``sharding``); absent for experts of other EP ranks.
    full_shapes: the names held and their full shapes (default: the model's, :func:`checkpoint_shapes`; a
    speculative draft's store holds its MTP layer's, ``engines.mtp_draft.mtp_shapes``); any other name is
    skipped on load.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        layout: Layout,
        tp_rank: int,
        dtype: torch.dtype,
        full_shapes: dict[str, tuple[int, ...]] | None = None,
    ):
        self.config, self.layout, self.tp_rank, self.dtype = config, layout, tp_rank, dtype
        self.full_shapes = checkpoint_shapes(config) if full_shapes is None else dict(full_shapes)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.prefix = language_model_of(config)[1]  # a vision-language checkpoint's language-model prefix
        self.shards: dict[str, torch.Tensor] = {}
        self.released = False
        self.backup: dict | None = None  # --enable-weights-cpu-backup's host copy while released
        for name, shape in self.full_shapes.items():
            part = shard_for_rank(name, torch.empty(shape, device="meta"), tp_rank, layout)
            if part is not None:
                self.shards[name] = torch.zeros(part.shape, dtype=dtype)

    def skipped(self, name: str) -> bool:
        """True for names sglang's load_weights skips without error."""
        if "rotary_emb.inv_freq" in name:
            return True
        if self.tied and name == "lm_head.weight":
            return True
        if outside_language_model(name, self.prefix):
            return True
        return checkpoint_name(name, self.prefix) not in self.full_shapes

    @torch.no_grad()
    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load full HF tensors by name (sharded here); returns how many were stored on this rank."""
        if self.released:
            raise RuntimeError("weights are released (release_memory_occupation); resume them before loading")
        stored = 0
        for name, full in named:
            if self.skipped(name):
                continue
            name = checkpoint_name(name, self.prefix)  # sglang's other spelling of the same tensor
            if tuple(full.shape) != self.full_shapes[name]:
                raise ValueError(
                    f"weight {name!r}: shape {tuple(full.shape)} does not match the model's {self.full_shapes[name]}"
                )
            part = shard_for_rank(name, full, self.tp_rank, self.layout)
            if part is None:
                continue
            self.shards[name].copy_(part.to(self.dtype))
            stored += 1
        return stored

    def load_dummy(self, seed: int) -> None:
        for name, shape in self.full_shapes.items():
            if name in self.shards:
                self.load([(name, dummy_tensor(name, shape, seed))])

    def resident_bytes(self) -> int:
        """Bytes of storage the shards hold now (0 after a weights release)."""
        return sum(t.untyped_storage().nbytes() for t in self.shards.values())

    def release(self, cpu_backup: bool = False) -> None:
        """Free the shards' storage (torch_memory_saver's pause on GPU; contents are lost unless
        ``cpu_backup``: sglang's ``--enable-weights-cpu-backup`` keeps a host copy)."""
        self.backup = {n: t.clone() for n, t in self.shards.items()} if cpu_backup else None
        for t in self.shards.values():
            t.untyped_storage().resize_(0)
        self.released = True

    def resume(self) -> None:
        """Give the storage back: the host copy restored (CPU backup), else zero-filled: as with
        sglang's memory saver without CPU backup, the old values are gone and the trainer syncs the
        weights after resuming them."""
        backup = self.backup
        for n, t in self.shards.items():
            t.untyped_storage().resize_(t.numel() * t.element_size())
            t.copy_(backup[n]) if backup is not None else t.zero_()
        self.backup = None
        self.released = False


def load_config(model_path: str) -> PretrainedConfig:
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"--model-path {model_path}: no config.json")
    return AutoConfig.from_pretrained(model_path)
