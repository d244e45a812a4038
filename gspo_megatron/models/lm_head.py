"""GPTModel's forward without its output layer: the hidden states that would enter it, and its weight.

Megatron-Core 0.16.1's ``GPTModel.forward`` has no switch to return the final hidden states on the last
pipeline stage: ``_postprocess`` always calls ``self.output_layer(hidden, weight=output_weight,
runtime_gather_output=...)`` (a ``ColumnParallelLinear``) and returns ``logits.transpose(0, 1)``. So
for the duration of one forward call :func:`lm_forward` replaces that module's ``forward`` on the
instance with :func:`_enter_output_region`, which does to the input exactly what
ColumnParallelLinear does before its GEMM and nothing else:

- sequence parallel: ``gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)``
  ([s/tp, b, H] -> [s, b, H]; backward: reduce-scatter of the TP ranks' partial input gradients);
- tensor parallel without SP: ``copy_to_tensor_model_parallel_region(h)`` (backward: all-reduce);
- TP 1: the identity.

GPTModel then returns these states as [b, s, H] (its own transpose). The loss side
(:func:`gspo_megatron.losses.fused_logprobs.fused_vocab_parallel_logprobs`) multiplies them by the
output weight shard chunk by chunk. The weight is :func:`output_weight`: the tied embedding's
``word_embeddings.weight`` when ``share_embeddings_and_output_weights`` on a stage that holds the
embedding (Megatron's ``shared_embedding_or_output_weight``), else ``output_layer.weight``. Megatron's
own machinery for tied weights across pipeline stages (the embedding-group gradient all-reduce in
``finalize_model_grads``) is unchanged: the gradient lands on the same parameter.

Every rank calls :func:`lm_forward` (it is the model's forward); only the last pipeline stage
(``model.post_process``) gets a weight back. Refused (ValueError) for megatron's own multi-token
prediction (its loss runs the output layer on extra hidden states inside ``_postprocess``; the draft of
``models/mtp.py`` does not) and
``defer_embedding_wgrad_compute`` (its wgrad buffers belong to the real output layer).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def unwrap_gpt(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    from megatron.core.models.gpt import GPTModel

    while not isinstance(model, GPTModel) and hasattr(model, "module"):
        model = model.module
    if not isinstance(model, GPTModel):
        raise TypeError(f"expected a Megatron GPTModel (possibly wrapped), got {type(model).__name__}")
    return model


def output_weight(gpt) -> torch.Tensor:
    """The [V/tp, H] weight the output layer multiplies by on this (last) stage."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def mtp_output_weight(model) -> torch.Tensor:
    """The [V/tp, H] output weight shard the MTP layers' states are multiplied by (``logits_k = d_k W^T``),
    DETACHED: the draft's loss and acceptance never move the output layer (``models/mtp.py``). The same
    tensor as :func:`output_weight` on the stage holding the MTP block (the last one)."""
    return output_weight(unwrap_gpt(model)).detach()


def check_fused_supported(gpt) -> None:
    cfg = gpt.config
    if getattr(cfg, "mtp_num_layers", None) and not hasattr(gpt, "_draft_sink"):
        raise ValueError(
            "model.fused_logprobs needs a model without megatron's own multi-token-prediction loss "
            "(mtp_num_layers outside models/mtp.MTPGPTModel); set model.fused_logprobs=false"
        )
    if getattr(cfg, "defer_embedding_wgrad_compute", False):
        raise ValueError(
            "model.fused_logprobs is incompatible with defer_embedding_wgrad_compute; set model.fused_logprobs=false"
        )


def _enter_output_region(layer, input_, weight=None, runtime_gather_output=None):
    """ColumnParallelLinear's input handling without its GEMM; returns ``(hidden, None)`` like it."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    group = layer.tp_group
    if group is None or group.size() == 1:
        return input_, None
    if layer.sequence_parallel:
        return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=group), None
    return copy_to_tensor_model_parallel_region(input_, group=group), None


@contextmanager
def _hidden_output(gpt):
    layer = gpt.output_layer
    layer.forward = lambda *args, **kwargs: _enter_output_region(layer, *args, **kwargs)
    try:
        yield
    finally:
        del layer.forward  # back to the class's forward


def lm_forward(
    model, tokens: torch.Tensor, position_ids: torch.Tensor, *, fused: bool, drafts: list | None = None, **kwargs
):
    """One forward of ``model`` (a GPTModel, possibly wrapped) on [b, s] tokens.

    Returns ``(output, weight)``:
    - ``fused=False``: GPTModel's output unchanged ([b, s, V/tp] logits on the last stage) and None;
    - ``fused=True`` on the last stage: hidden states [b, s, H] (full sequence, in the TP region) and
      the output weight shard [V/tp, H];
    - on other stages: the stage's output (hidden states for the next stage) and None.
    ``kwargs`` go to GPTModel.forward (attention_mask, packed_seq_params, ...). ``drafts`` (a list, for a
    model built with its MTP layer, ``models/mtp.py``): on the stage holding the MTP block (the last), MTP
    layer k's states d_k [b, s, H] are appended for k = 1..M, in the same region as the fused path's
    hidden states (gathered over sequence parallel), computed from detached inputs; d_k[:, i] predicts
    token i + k + 1 (``logits = d_k mtp_output_weight(model)^T``; within each packed sequence). None (or a
    model without MTP): the MTP block does not run and the forward is the plain GPTModel's.
    """
    gpt = unwrap_gpt(model)
    if drafts is not None and getattr(gpt, "mtp_process", False):
        kwargs["drafts"] = drafts
    if not fused or not gpt.post_process:
        return model(tokens, position_ids, **kwargs), None
    check_fused_supported(gpt)
    with _hidden_output(gpt):
        hidden = model(tokens, position_ids, **kwargs)
    return hidden, output_weight(gpt)
