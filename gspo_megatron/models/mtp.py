"""The checkpoint's multi-token-prediction (MTP) layer inside the trained Megatron model (``model.mtp``).

Built with megatron-core 0.16.1's own MTP block (``transformer/multi_token_prediction.py``:
``MultiTokenPredictionBlock`` of ``MultiTokenPredictionLayer`` s: ``enorm``, ``hnorm``, ``eh_proj``, the
decoder layer's spec as ``transformer_layer``, ``final_layernorm``; ``get_gpt_mtp_block_spec``), inside
:class:`MTPGPTModel`, a GPTModel whose ``_postprocess`` is ours (composed at build, no patch of
megatron's class): megatron's own would compute the MTP loss from ``labels`` and send its gradient into
the main model (DeepSeek-V3's pre-training recipe). Here the MTP layer is the engines' draft, trained on
the rollout's tokens without moving the policy (as slime does):

- the caller asks for the draft's states per forward (``lm_forward(..., drafts=[])``); otherwise the
  MTP block does not run and the forward is the plain GPTModel's, bit for bit;
- asked, the block reads the decoder's output DETACHED and the embedding of the rolled tokens DETACHED
  (:class:`_DetachedEmbedding`), so a loss on its states reaches the MTP layer's own parameters only
  (the caller multiplies them by the output weight detached: ``losses/mtp_loss.py``);
- MTP layer k's output [s, b, H] (sequence-parallel scattered) enters the output layer's region as the
  main states do (``lm_head._enter_output_region``) and is handed over as [b, s, H]: position i predicts
  token i + k + 1 (megatron rolls the input ids and positions by one per layer, within packed sequences).

Names (``mtp_rules``): megatron ``mtp.layers.{k}.{enorm,hnorm,eh_proj,final_layernorm}.weight`` and
``mtp.layers.{k}.transformer_layer.*`` <-> HF ``model.layers.{N+k}.{enorm,hnorm,eh_proj,shared_head.norm}
.weight`` and the decoder layer's names under ``model.layers.{N+k}.`` (the family's own decoder rules with
the layer index shifted by N = ``num_hidden_layers``), as sglang 0.5.23's draft loads them
(``srt/models/deepseek_common/deepseek_weight_loader.py``, ``is_nextn``). The layer's ``embed_tokens``
and ``shared_head.head`` stay carried (``models/carried.py``): sglang's draft skips them and shares the
target's embedding and head (``set_embed_and_head``), as megatron's MTP shares the model's.

Refused (:func:`mtp_errors`): a family whose MTP layer is not built here, a checkpoint without one, more
than one (sglang 0.5.23's NextN loader asserts ``num_nextn_predict_layers == 1``); layouts
(:func:`mtp_layout_errors`): pipeline and context parallelism.
"""

from __future__ import annotations

import copy

import torch

from gspo_megatron.models import carried
from gspo_megatron.models.mapping import MappingRegistry, Replicated, Rule, _pattern_regex

MTP_PREFIX = "mtp.layers."
_DECODER = "decoder.layers.*."


def mtp_errors(hf: dict, trained: bool = True) -> list[str]:
    """Why the MTP layer of the checkpoint with config.json ``hf`` cannot be the trained and synced
    draft (``trained``), or the engines' published draft (``trained=False``: only a checkpoint without
    one is refused) (one line each; empty: it can)."""
    from gspo_megatron.models.registry import get_family

    family = get_family(hf)
    m = carried.mtp_layers(hf)
    if not family.sglang_draft_modules and not m:
        return [f"the {family.name} family has no MTP layers (no draft for speculative decoding)"]
    if not trained:
        return [] if m else [f"config.json declares no MTP layer ({'/'.join(carried.COUNT_FIELDS)} = 0)"]
    if not family.mtp_trainable:
        return [
            f"the {family.name} family's MTP layers are not built into the Megatron model here yet "
            "(glm4_moe and deepseek_v3 are); set model.mtp=false and rollout.speculative=false"
        ]
    if m == 0:
        return [
            f"config.json declares no MTP layer ({'/'.join(carried.COUNT_FIELDS)} = 0): the checkpoint has no draft"
        ]
    if m != 1:
        return [
            f"config.json declares {m} MTP layers; sglang 0.5.23 serves exactly 1 "
            "(srt/models/deepseek_common/deepseek_weight_loader.py asserts num_nextn_predict_layers == 1)"
        ]
    return []


def mtp_layout_errors(pp: int, cp: int) -> list[str]:
    """The layouts the MTP layer is not built for here (one line each)."""
    out = []
    if pp > 1:
        out.append(f"model.mtp=true needs parallel.pp=1 here (got {pp}): the MTP layer's stage is not mapped yet")
    if cp > 1:
        out.append(f"model.mtp=true needs parallel.cp=1 (got {cp})")
    return out


def mtp_rules(registry: MappingRegistry, hf: dict) -> MappingRegistry:
    """``registry`` plus the MTP layer's rules (module docstring): its own four tensors and every
    decoder-layer rule moved under ``mtp.layers.*.transformer_layer.`` with the HF layer index + N."""
    n = int(hf["num_hidden_layers"])
    own: list[Rule] = [
        Replicated("mtp.layers.*.enorm.weight", "model.layers.*.enorm.weight"),
        Replicated("mtp.layers.*.hnorm.weight", "model.layers.*.hnorm.weight"),
        _column("mtp.layers.*.eh_proj.weight", "model.layers.*.eh_proj.weight"),
        Replicated("mtp.layers.*.final_layernorm.weight", "model.layers.*.shared_head.norm.weight"),
    ]
    for r in own:
        r.hf_layer_offset = n
    moved = []
    for r in registry.rules:
        if not r.megatron.startswith(_DECODER):
            continue
        m = copy.copy(r)
        m.megatron = f"{MTP_PREFIX}*.transformer_layer." + r.megatron[len(_DECODER) :]
        m._regex = _pattern_regex(m.megatron)
        m.hf_layer_offset = n
        moved.append(m)
    return MappingRegistry(registry.rules + own + moved, registry.fuse_groups)


def model_mapping(model) -> MappingRegistry:
    """The mapping of one GPTModel chunk: its family's, plus :func:`mtp_rules` when it holds the MTP
    block (``model.mtp``)."""
    from gspo_megatron.models.registry import get_family

    registry = get_family(model.hf_config).mapping(model.hf_config)
    return mtp_rules(registry, model.hf_config) if getattr(model, "mtp_process", False) else registry


def _column(megatron: str, hf: str) -> Rule:
    from gspo_megatron.models.mapping import ColumnParallel

    return ColumnParallel(megatron, hf, "tp")


class _DetachedEmbedding:
    """The model's embedding with its output detached (no gradient into the policy's embedding)."""

    def __init__(self, embedding):
        self.embedding = embedding

    def __call__(self, input_ids, position_ids):
        return self.embedding(input_ids=input_ids, position_ids=position_ids).detach()


def mtp_gpt_model_class():
    """:class:`MTPGPTModel` (built on first use: megatron is imported lazily everywhere in models/)."""
    global _MTP_CLASS
    if _MTP_CLASS is None:
        _MTP_CLASS = _define()
    return _MTP_CLASS


_MTP_CLASS = None


def _define():
    from megatron.core.models.gpt import GPTModel

    class MTPGPTModel(GPTModel):
        """GPTModel holding the MTP block as the draft (module docstring). ``forward(..., drafts=list)``
        appends MTP layer k's states [b, s, H] (k = 1..M, the output layer's input region) to the list on
        the stage holding the MTP block; ``drafts=None``: the block does not run."""

        _draft_sink: list | None = None

        def forward(self, *args, drafts: list | None = None, **kwargs):
            self._draft_sink = drafts
            try:
                return super().forward(*args, **kwargs)
            finally:
                self._draft_sink = None

        def _postprocess(
            self,
            hidden_states,
            input_ids,
            position_ids,
            labels,
            rotary_pos_emb,
            rotary_pos_cos,
            rotary_pos_sin,
            mtp_in_postprocess=None,
            loss_mask=None,
            decoder_input=None,
            attention_mask=None,
            inference_params=None,
            packed_seq_params=None,
            sequence_len_offset=None,
            runtime_gather_output=None,
            extra_block_kwargs=None,
            inference_context=None,
        ):
            if labels is not None or inference_context is not None:
                raise ValueError("MTPGPTModel runs the trainer's forward only (labels=None, no inference context)")
            sink = self._draft_sink
            if sink is not None and mtp_in_postprocess:
                from gspo_megatron.models.lm_head import _enter_output_region

                states = self.mtp(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    hidden_states=hidden_states.detach(),
                    attention_mask=attention_mask,
                    rotary_pos_emb=rotary_pos_emb,
                    rotary_pos_cos=rotary_pos_cos,
                    rotary_pos_sin=rotary_pos_sin,
                    packed_seq_params=packed_seq_params,
                    sequence_len_offset=sequence_len_offset,
                    embedding=_DetachedEmbedding(self.embedding),
                    **(extra_block_kwargs or {}),
                )
                for h in torch.chunk(states, 1 + self.config.mtp_num_layers, dim=0)[1:]:
                    region, _ = _enter_output_region(self.output_layer, h)
                    sink.append(region.transpose(0, 1))  # [s, b, H] -> [b, s, H]
            if not self.post_process:
                return hidden_states
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
            return logits.transpose(0, 1).contiguous()  # [s, b, V/tp] -> [b, s, V/tp], as GPTModel

    return MTPGPTModel
