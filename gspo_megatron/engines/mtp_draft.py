"""The multi-token-prediction (MTP) layer of a DeepSeek-V3 / GLM-4.5 / Qwen3-Next checkpoint as a draft model:
the reference forward (full recompute, no KV cache) that the CPU server drafts with and that the Megatron
MTP layer is compared against.

The published MTP math (DeepSeek-V3 report, section 2.2; sglang 0.5.23 ``srt/models/deepseek_nextn.py``
``DeepseekModelNextN.forward``, ``srt/models/glm4_moe_nextn.py`` ``Glm4MoeModelNextN.forward`` and
``srt/models/qwen3_next_mtp.py`` ``Qwen3NextForCausalLMMTP.forward``: the same math under other names), for the
MTP inputs j = 0..T-1 (x_j a token id, h_j [H] a hidden state, p_j a position id)::

    e_j = RMSNorm_enorm(E[x_j])                 E = the target's embedding [V, H]
    u_j = RMSNorm_hnorm(h_j)
    z_j = W_eh @ cat(e_j, u_j)                  eh_proj.weight [H, 2H] (no bias); embedding half first
    g   = RMSNorm_shared_head.norm(DecoderLayer(z)_{causal attention over j' <= j, RoPE at p_j})   [T, H]
    logits_j = W_head @ g_j                     the target's lm_head.weight [V, H]

``DecoderLayer`` is transformers' own decoder layer class of the family (the class of the model's
``layers[i]``, found through the checkpoint's architecture; a DeepSeek-style layer index N >=
``first_k_dense_replace`` builds routed experts), built with index N = ``num_hidden_layers``, with the
family's rotary embedding; Qwen3-Next's is layer 0 of a one-layer model of full attention with routed
experts (sglang's ``full_attention_interval = 1``). The norms are the family's RMSNorm (the class of the
layer's ``input_layernorm``: Qwen3-Next's zero-centered ``x / rms(x) * (1 + w)``, sglang's ``GemmaRMSNorm``),
eps ``rms_norm_eps``.

Pairing when drafting (sglang 0.5.23 ``srt/speculative/eagle_worker_v2.py`` draft extend and
``eagle_info.py``: the draft's input ids are the target's shifted left by one, its positions the
target's): h_j is the target's final hidden state at position p_j = j (after the final norm:
``LogitsProcessor`` captures the hidden state the head is applied to, ``srt/layers/logits_processor.py``;
transformers' last ``hidden_states`` entry is ``last_hidden_state``, the post-norm one,
``utils/output_capturing.py`` ``tie_last_hidden_states``), x_j = t_{j+1} is the token after it, and
logits_j predicts t_{j+2}. A draft step feeds its own g_j as the next h and its own proposal as the next
x (``DeepseekModelNextN`` returns the normed state as the hidden state the next draft step reads).

Weights: the MTP layer's HF tensors where the family's ``models/mtp.MTPNaming`` puts them: DeepSeek-V3 /
GLM-4.5 ``model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}.weight`` and the decoder layer
``model.layers.{N}.*``; Qwen3-Next ``mtp.{pre_fc_norm_embedding,pre_fc_norm_hidden,fc,norm}.weight`` and
``mtp.layers.0.*``; in the checkpoint layout (one tensor per expert: loaded through
``engines.hf_engine.HFCheckpointLayout``). DeepSeek's layer's own ``embed_tokens`` / ``shared_head.head`` of a
published checkpoint are not used: sglang's draft shares the target's embedding and head
(``srt/models/deepseek_common/deepseek_weight_loader.py`` and ``srt/speculative/eagle_worker_v2.py`` ``set_embed_and_head``).
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Mapping, cast

import torch
from torch import nn

from gspo_megatron.engines.hf_engine import HFCheckpointLayout


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
    mask of :meth:`MTPDraft.forward`, transformers' per-expert loop); of a vision-language checkpoint
    (Qwen3.5-MoE's), its language model's."""
    from gspo_megatron.engines.hf_engine import language_model_of

    config = language_model_of(_hf_config(hf))[0]  # a vision-language checkpoint's: its language model's
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def mtp_naming_of(config):
    """The checkpoint's :class:`~gspo_megatron.models.mtp.MTPNaming` (its family's) for transformers' config."""
    from gspo_megatron.models.mtp import mtp_naming

    return mtp_naming({"model_type": config.model_type, "architectures": list(config.architectures or [])})


def _layer_config(config, naming):
    """The config the MTP decoder layer is built from: the model's, or for an MTP branch (Qwen3-Next's
    ``mtp.*``, :data:`~gspo_megatron.models.mtp.MTP_BRANCH`) a one-layer model of full attention with
    routed experts, as sglang 0.5.23 builds it (``srt/models/qwen3_next_mtp.py``: ``num_hidden_layers = 1``,
    ``full_attention_interval = 1``; its MoE in every layer)."""
    if naming.after_decoder:
        return config
    one = copy.deepcopy(config)
    one.num_hidden_layers = 1
    one.layer_types = ["full_attention"]
    one.full_attention_interval = 1
    one.mlp_only_layers = []
    one.decoder_sparse_step = 1
    return one


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under ``root`` at the dotted ``path`` (missing parents as empty modules)."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        child = node._modules.get(name)
        if child is None:
            child = nn.Module()
            node.add_module(name, child)
        node = child
    node.add_module(leaf, module)


def build_mtp_layer(root: nn.Module, config, index: int | None = None) -> tuple[dict[str, nn.Module], nn.Module, int]:
    """Build the checkpoint's MTP layer into ``root`` under its HF names (the family's ``MTPNaming``): the
    decoder layer of the family (:func:`transformers_layer_classes`, built as layer ``index``, default the
    naming's: N, or 0 for an MTP branch), ``enorm``, ``hnorm`` (the family's RMSNorm: the class of the
    layer's ``input_layernorm``), ``eh_proj`` (Linear 2H -> H, no bias) and the final norm. Returns (the
    parts by role: ``block``, ``enorm``, ``hnorm``, ``eh_proj``, ``final_norm``; the rotary embedding; the
    layer's HF index)."""
    naming = mtp_naming_of(config)
    i = naming.index({"num_hidden_layers": config.num_hidden_layers}) if index is None else int(index)
    layer_config = _layer_config(config, naming)
    layer_cls, rotary_cls = transformers_layer_classes(layer_config)
    block = layer_cls(layer_config, layer_idx=i)
    norm_cls = type(block.input_layernorm)
    hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
    parts: dict[str, nn.Module] = {"block": block}
    _attach(root, naming.layer.format(i=i)[:-1], block)
    modules = dict(
        enorm=norm_cls(hidden, eps=eps),
        hnorm=norm_cls(hidden, eps=eps),
        eh_proj=nn.Linear(2 * hidden, hidden, bias=False),
        final_norm=norm_cls(hidden, eps=eps),
    )
    for role, pattern in zip(modules, (naming.enorm, naming.hnorm, naming.eh_proj, naming.final_norm)):
        _attach(root, pattern.format(i=i).removesuffix(".weight"), modules[role])
    parts.update(modules)
    return parts, rotary_cls(config=layer_config), i


def mtp_shapes(hf, layer: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the MTP layer (:meth:`MTPDraft.names`: the decoder layer, experts one
    tensor each, and its own four) -> its full shape, built on the meta device (no memory)."""
    config = mtp_config(hf)
    root = nn.Module()
    root.config = config  # what the layout reads besides named_parameters
    with torch.device("meta"):
        build_mtp_layer(root, config, layer)
    layout = HFCheckpointLayout(cast(Any, root))  # the layout reads named_parameters only
    return {n: tuple(layout.target(n).shape) for n in layout.checkpoint_names()}


class MTPDraft(nn.Module):
    """One MTP layer as a draft model (module docstring: the math, the pairing, the names).

    hf: the checkpoint's config.json (a dict, or transformers' config). tensors: HF-named tensors of the
    MTP layer (``model.layers.{N}.*`` or ``mtp.*``; DeepSeek's ``embed_tokens`` / ``shared_head.head`` of the
    layer are ignored), every one of :meth:`names` present. embed [V, H], lm_head [V, H]: the target's
    embedding and head weights, kept by reference (:meth:`set_embed_and_head`), so a caller sharing the
    target's live parameters drafts with its current ones. layer: the layer's HF index (default the
    naming's: ``num_hidden_layers`` after the decoder, 0 in an ``mtp.*`` branch). dtype: of the layer's
    parameters (fp32 default).
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
        parts, rotary, index = build_mtp_layer(self, config, layer)
        self._parts = parts  # by role (a dict: not registered twice; the names are the checkpoint's)
        self.rotary = rotary
        naming = mtp_naming_of(config)
        self._shared_names = {naming.layer.format(i=index) + s for s in naming.shared}
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
        """The MTP layer's decoder layer."""
        return self._parts["block"]

    def names(self) -> list[str]:
        """Every HF tensor name the draft loads: the decoder layer's (experts one tensor each) and the
        layer's own four (``model.layers.{N}.*`` or ``mtp.*``: the family's ``MTPNaming``)."""
        return list(self.layout.checkpoint_names())

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors of the MTP layer in (the layer's copies of the embedding and head skipped);
        returns the names loaded. Raises KeyError on a name the layer does not have, ValueError on a shape
        mismatch."""
        done = set()
        for name, tensor in tensors:
            if name in self._shared_names:
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
        p = self._parts
        b = p["block"]
        dtype: torch.dtype = cast(nn.Linear, p["eh_proj"]).weight.dtype
        t = int(input_ids.shape[0])
        if hidden.shape[0] != t or position_ids.shape[0] != t:
            raise ValueError(
                f"MTPDraft: hidden {tuple(hidden.shape)}, input_ids {t}, position_ids {tuple(position_ids.shape)} disagree on T"
            )
        e = self.embed[input_ids.long()].to(dtype)
        z = p["eh_proj"](torch.cat([p["enorm"](e), p["hnorm"](hidden.to(dtype))], dim=-1))[None]  # [1, T, H]
        pos = position_ids.long()[None]
        mask = torch.full((t, t), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]  # [1, 1, T, T]
        cos_sin = self.rotary(z, pos)
        out = b(z, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        if isinstance(out, tuple):
            out = out[0]
        g = p["final_norm"](out)[0]
        return g, g @ self.lm_head.to(dtype).t()
