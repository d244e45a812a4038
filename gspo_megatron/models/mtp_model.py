"""The GPTModel that holds the checkpoint's MTP layer as the engines' draft (``model.mtp``): what it
computes and why is in ``models/mtp.py`` (the refusals and the weight names live there, light to
import); ``models.build.build_model`` builds this class when ``ModelOptions.mtp`` is set."""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from gspo_megatron.models.lm_head import _enter_output_region


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
