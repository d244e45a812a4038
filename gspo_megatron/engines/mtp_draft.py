"""The multi-token-prediction (MTP) layer of a DeepSeek-V3 / GLM-4.5 checkpoint as a draft model: the
reference forward (full recompute, no KV cache) that the CPU server drafts with and that the Megatron
MTP layer is compared against.

The published MTP math (DeepSeek-V3 report, section 2.2; sglang 0.5.23 ``srt/models/deepseek_nextn.py``
``DeepseekModelNextN.forward`` and ``srt/models/glm4_moe_nextn.py`` ``Glm4MoeModelNextN.forward``), for the
MTP inputs j = 0..T-1 (x_j a token id, h_j [H] a hidden state, p_j a position id)::

    e_j = RMSNorm_enorm(E[x_j])                 E = the target's embedding [V, H]
    u_j = RMSNorm_hnorm(h_j)
    z_j = W_eh @ cat(e_j, u_j)                  eh_proj.weight [H, 2H] (no bias); embedding half first
    g   = RMSNorm_shared_head.norm(DecoderLayer(z)_{causal attention over j' <= j, RoPE at p_j})   [T, H]
    logits_j = W_head @ g_j                     the target's lm_head.weight [V, H]

``DecoderLayer`` is transformers' own decoder layer class of the family (the class of the model's
``layers[i]``, found through the checkpoint's architecture; a DeepSeek-style layer index N >=
``first_k_dense_replace`` builds routed experts), built with index N = ``num_hidden_layers``, with the
family's rotary embedding. The norms are the family's RMSNorm (the class of the layer's
``input_layernorm``), eps ``rms_norm_eps``.

Pairing when drafting (sglang 0.5.23 ``srt/speculative/eagle_worker_v2.py`` draft extend and
``eagle_info.py``: the draft's input ids are the target's shifted left by one, its positions the
target's): h_j is the target's final hidden state at position p_j = j (after the final norm:
``LogitsProcessor`` captures the hidden state the head is applied to, ``srt/layers/logits_processor.py``;
transformers' last ``hidden_states`` entry is ``last_hidden_state``, the post-norm one,
``utils/output_capturing.py`` ``tie_last_hidden_states``), x_j = t_{j+1} is the token after it, and
logits_j predicts t_{j+2}. A draft step feeds its own g_j as the next h and its own proposal as the next
x (``DeepseekModelNextN`` returns the normed state as the hidden state the next draft step reads).

Weights: the MTP layer's HF tensors ``model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}.weight`` and
the decoder layer ``model.layers.{N}.*`` in the checkpoint layout (one tensor per expert: loaded through
``engines.hf_engine.HFCheckpointLayout``). The layer's own ``embed_tokens`` / ``shared_head.head`` of a
published checkpoint are not used: sglang's draft shares the target's embedding and head
(``srt/models/deepseek_common/deepseek_weight_loader.py`` and ``srt/speculative/eagle_worker_v2.py`` ``set_embed_and_head``).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping, cast

import torch
from torch import nn

from gspo_megatron.engines.hf_engine import HFCheckpointLayout

# the MTP layer's own tensors besides its decoder layer (model.layers.{N}.<name>)
MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
# the published layer's copies of the target's embedding and head: sglang's draft uses the target's
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


def _hf_config(hf: Mapping):
    """transformers' config object of an HF config dict (``model_type`` required)."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(hf, PretrainedConfig):
        return copy.deepcopy(hf)
    cfg = {k: v for k, v in dict(hf).items() if k != "transformers_version"}
    if "model_type" not in cfg:
        raise ValueError("MTPDraft: config.json has no model_type")
    return AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def transformers_layer_classes(config) -> tuple[type, type]:
    """(decoder layer class, rotary embedding class) of transformers' causal LM for ``config``: the
    classes of ``model.layers[0]`` and ``model.rotary_emb`` of the architecture's model class
    (``config.architectures[0]``, else transformers' causal-LM mapping), built with one layer on the
    meta device (no memory)."""
    import transformers

    archs = list(getattr(config, "architectures", None) or [])
    model_cls: Any = getattr(transformers, archs[0], None) if archs else None
    if model_cls is None:
        model_cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    with torch.device("meta"):
        meta = model_cls(one)
    base = getattr(meta, meta.base_model_prefix)
    return type(base.layers[0]), type(base.rotary_emb)


def mtp_config(hf):
    """transformers' config for the MTP layer's modules (eager attention and experts: the explicit causal
    mask of :meth:`MTPDraft.forward`, transformers' per-expert loop)."""
    config = _hf_config(hf)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def mtp_block(config, index: int) -> nn.Module:
    """The MTP layer ``model.layers.{index}``: transformers' decoder layer of the family built as layer
    ``index`` (:func:`transformers_layer_classes`), with ``enorm``, ``hnorm`` (the family's RMSNorm),
    ``eh_proj`` (Linear 2H -> H, no bias) and ``shared_head.norm`` riding on it, so that its parameter
    names are the checkpoint's."""
    layer_cls, _ = transformers_layer_classes(config)
    block = layer_cls(config, layer_idx=index)
    norm_cls = type(block.input_layernorm)
    hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
    block.enorm = norm_cls(hidden, eps=eps)
    block.hnorm = norm_cls(hidden, eps=eps)
    block.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
    block.shared_head = nn.Module()
    block.shared_head.norm = norm_cls(hidden, eps=eps)
    return block


class _Holder(nn.Module):
    """``model.layers.{N}`` around an MTP block, so that parameter names are the checkpoint's."""

    def __init__(self, config, index: int, block: nn.Module):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(index): block})


def mtp_shapes(hf, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the MTP layer (:meth:`MTPDraft.names`: the decoder layer, experts one
    tensor each, and :data:`MTP_OWN`) -> its full shape, built on the meta device (no memory)."""
    config = mtp_config(hf)
    index = int(config.num_hidden_layers if layer is None else layer)
    with torch.device("meta"):
        holder = _Holder(config, index, mtp_block(config, index))
    layout = HFCheckpointLayout(cast(Any, holder))  # the layout reads named_parameters only
    return {
        n: tuple(layout.target(n).shape) for n in layout.checkpoint_names() if n.startswith(f"model.layers.{index}.")
    }


class MTPDraft(nn.Module):
    """One MTP layer as a draft model (module docstring: the math, the pairing, the names).

    hf: the checkpoint's config.json (a dict, or transformers' config). tensors: HF-named tensors of the
    MTP layer (``model.layers.{N}.*``; ``embed_tokens`` / ``shared_head.head`` of the layer are ignored),
    every one of :meth:`names` present. embed [V, H], lm_head [V, H]: the target's
    ``model.embed_tokens.weight`` and ``lm_head.weight``, kept by reference (:meth:`set_embed_and_head`),
    so a caller sharing the target's live parameters drafts with its current ones. layer: N (default
    ``num_hidden_layers``, the first MTP layer). dtype: of the layer's parameters (fp32 default).
    """

    def __init__(
        self,
        hf,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        *,
        layer: int | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        config = mtp_config(hf)
        self.config = config
        self.index = int(config.num_hidden_layers if layer is None else layer)
        self.prefix = f"model.layers.{self.index}."
        _, rotary_cls = transformers_layer_classes(config)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(self.index): mtp_block(config, self.index)})
        self.rotary = rotary_cls(config=config)
        self.to(dtype).eval()
        self.layout = HFCheckpointLayout(cast(Any, self))  # the layout reads named_parameters only
        self.set_embed_and_head(embed, lm_head)
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        loaded = self.load(items)
        missing = sorted(set(self.names()) - loaded)
        if missing:
            raise ValueError(f"MTPDraft: the MTP layer's tensors lack {len(missing)} names, e.g. {missing[:3]}")

    @property
    def block(self) -> Any:
        """The decoder layer carrying the MTP modules (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``)."""
        return cast(nn.ModuleDict, self.model.layers)[str(self.index)]

    def names(self) -> list[str]:
        """Every HF tensor name the draft loads: ``model.layers.{N}.*`` (the decoder layer and
        :data:`MTP_OWN`; experts one tensor each)."""
        return [n for n in self.layout.checkpoint_names() if n.startswith(self.prefix)]

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors of the MTP layer in (:data:`MTP_SHARED` skipped); returns the names
        loaded. Raises KeyError on a name the layer does not have, ValueError on a shape mismatch."""
        done = set()
        for name, tensor in tensors:
            if name.startswith(self.prefix) and name[len(self.prefix) :] in MTP_SHARED:
                continue
            self.layout.load(name, tensor)
            done.add(name)
        return done

    def set_embed_and_head(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Use the target's embedding [V, H] and head [V, H] (sglang's ``set_embed_and_head``)."""
        if embed.dim() != 2 or tuple(embed.shape) != tuple(lm_head.shape):
            raise ValueError(
                f"MTPDraft: embed {tuple(embed.shape)} and lm_head {tuple(lm_head.shape)} must both be [V, H]"
            )
        self._shared = (embed, lm_head)  # a tuple: the target's Parameters are not registered here

    @property
    def embed(self) -> torch.Tensor:
        return self._shared[0]

    @property
    def lm_head(self) -> torch.Tensor:
        return self._shared[1]

    @torch.no_grad()
    def forward(
        self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] (h_j), input_ids [T] (x_j), position_ids [T] (p_j) -> (g [T, H], logits [T, V]),
        both in the layer's dtype; causal over j (module docstring)."""
        b = self.block
        dtype = b.eh_proj.weight.dtype
        t = int(input_ids.shape[0])
        if hidden.shape[0] != t or position_ids.shape[0] != t:
            raise ValueError(
                f"MTPDraft: hidden {tuple(hidden.shape)}, input_ids {t}, position_ids {tuple(position_ids.shape)} disagree on T"
            )
        e = self.embed[input_ids.long()].to(dtype)
        z = b.eh_proj(torch.cat([b.enorm(e), b.hnorm(hidden.to(dtype))], dim=-1))[None]  # [1, T, H]
        pos = position_ids.long()[None]
        mask = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]  # [1, 1, T, T]
        cos_sin = self.rotary(z, pos)
        out = b(z, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        if isinstance(out, tuple):
            out = out[0]
        g = b.shared_head.norm(out)[0]
        return g, g @ self.lm_head.to(dtype).t()
