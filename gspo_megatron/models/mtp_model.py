"""The GPTModel that holds the checkpoint's MTP layer as the engines' draft (``model.mtp``): what it
computes and why is in ``models/mtp.py`` (the refusals and the weight names live there, light to
import); ``models.build.build_model`` builds this class when ``ModelOptions.mtp`` is set."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
)

from gspo_megatron.models.lm_head import _enter_output_region


class _MTPLayer(MultiTokenPredictionLayer):
    """megatron-core 0.16.1's MTP layer, recomputed with packed sequences too. With ``model.recompute``
    (``recompute_granularity="full"``) megatron checkpoints the layer through ``tensor_parallel.checkpoint``
    with every keyword passed as a positional input (``MultiTokenPredictionLayer._checkpointed_forward``),
    and ``save_for_backward`` refuses the ``PackedSeqParams`` of a packed micro-batch (TypeError). Here the
    inputs that are not tensors are bound in the recomputed function instead (as megatron's
    ``TransformerBlock._checkpointed_forward`` does); the FP8 path (``te_checkpoint``, which takes keywords)
    and the other recompute methods are megatron's own."""

    def _checkpointed_forward(self, forward_func, *args, **kwargs):
        if args or self.config.fp8 or self.config.recompute_method != "uniform":
            return super()._checkpointed_forward(forward_func, *args, **kwargs)
        saved = [k for k, v in kwargs.items() if v is None or isinstance(v, torch.Tensor)]
        bound = {k: v for k, v in kwargs.items() if k not in saved}

        def run(*values):
            return forward_func(**dict(zip(saved, values)), **bound)

        return tensor_parallel.checkpoint(run, self.config.distribute_saved_activations, *[kwargs[k] for k in saved])


def mtp_block_spec(config, layer_spec, te: bool, family):
    """megatron's MTP block spec for the decoder layer spec ``layer_spec`` (``get_gpt_mtp_block_spec``: the
    last decoder layer's spec inside each MTP layer), its layers :class:`_MTPLayer`, each adapted by the
    ``family`` (``ModelFamily.adapt_mtp_layer_spec``: Qwen3-Next's full-attention MTP layer)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    block = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=te)
    if block is None:  # no MTP layer on this pipeline stage
        return None
    layers = [family.adapt_mtp_layer_spec(dataclasses.replace(s, module=_MTPLayer), te) for s in block.layer_specs]
    return MultiTokenPredictionBlockSubmodules(layer_specs=layers)


class _DetachedEmbedding:
    """The model's embedding with its output detached (no gradient into the policy's embedding)."""

    def __init__(self, embedding):
        self.embedding = embedding

    def __call__(self, input_ids, position_ids):
        return self.embedding(input_ids=input_ids, position_ids=position_ids).detach()


class MTPGPTModel(GPTModel):
    """GPTModel holding the MTP block as the draft (``models/mtp.py``'s docstring). ``forward(..., drafts=list)``
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
            # detached, yet a leaf that requires grad: with model.recompute megatron checkpoints the MTP layer
            # (an autograd Function whose parameters get a gradient only when an input requires one); the
            # gradient reaching this leaf is dropped
            states = self.mtp(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states.detach().requires_grad_(torch.is_grad_enabled()),
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
