"""Multi-latent attention on Transformer Engine's layer spec (megatron-core 0.16.1
``get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True, qk_layernorm=True)``).

Per TP rank (tp ranks, H heads, nope / rope / v head dims, q_lora / kv_lora ranks; what
``tests/models/test_deepseek_v3_te.py`` reads off megatron-core's own spec and TE wrappers):
- ``input_layernorm.weight`` [hidden]: ``TENorm`` (not fused into the attention);
- ``self_attention.linear_q_down_proj.weight`` [q_lora, hidden] and
  ``linear_kv_down_proj.weight`` [kv_lora + rope, hidden]: ``TELinear(parallel_mode="duplicated")``,
  the whole tensor on every TP rank (``MLASelfAttention.__init__``, multi_latent_attention.py);
- ``linear_q_up_proj.{layer_norm_weight [q_lora], weight [H (nope + rope) / tp, q_lora]}`` and
  ``linear_kv_up_proj.{layer_norm_weight [kv_lora], weight [H (nope + v) / tp, kv_lora]}``:
  ``TELayerNormColumnParallelLinear``, the q / kv RMSNorm fused in (``q_layernorm`` / ``kv_layernorm``
  are ``IdentityOp``); without ``q_lora_rank``: ``linear_q_proj.weight`` [H (nope + rope) / tp, hidden];
- ``linear_proj.weight`` [hidden, H v / tp] (``TERowParallelLinear``);
- dense layers: ``mlp.linear_fc1.{layer_norm_weight, weight}`` (the pre-MLP norm fused), MoE layers:
  ``pre_mlp_layernorm.weight`` (``TENorm``), ``mlp.router.weight`` + ``expert_bias``,
  ``mlp.experts.linear_fc{1,2}.weight<e>`` (``TEGroupedMLP``), ``mlp.shared_experts.linear_fc{1,2}``;
- every TE module's ``_extra_state`` (FP8 metadata) is in the state dict, not a parameter or buffer:
  checkpoints carry it, the HF mapping has nothing to say about it.

Megatron-Core 0.16.1 + TE fix (the gradient norm): ``TELinear`` gives the duplicated down projections
``sequence_parallel`` (their gradients are summed over TP, right), but TE's ``Linear.reset_parameters``
(transformer_engine/pytorch/module/linear.py) marks every weight ``tensor_model_parallel=True``, so
Megatron's grad norm (``param_is_not_tensor_parallel_duplicate``, optimizer.py / clip_grads.py) counts
these TP-replicated gradients on every TP rank: their squared norm tp times. ``TEMLASelfAttention``
clears the mark on them, as Megatron's own replicated parameters (norms) have it, so rank 0 of TP
counts them once. Same parameters, same forward.

DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the core attention is ours on both specs
(``deepseek_v32/indexer.DSALocalAttention``, in place of ``TEDotProductAttention``) and reads MLA's
``qr``. On this spec ``q_layernorm`` is an IdentityOp (the q RMSNorm is fused into
``linear_q_up_proj``), so ``qr`` is ``q_a_proj(x)`` unnormalized; ``TEMLASelfAttention`` hands such a
core attention ``linear_q_up_proj`` (``bind_fused_q_norm``), which normalizes ``qr`` as TE does
before the indexer reads it (transformers' ``q_resid = q_a_layernorm(q_a_proj(x))``). The indexer's
own parameters are plain replicated torch modules (frozen): not TE's, not in this fix.
"""

from __future__ import annotations

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

DOWN_PROJECTIONS = ("linear_q_down_proj", "linear_kv_down_proj")


class TEMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose TP-duplicated down projections count once in the grad norm."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        for name in DOWN_PROJECTIONS:
            linear = getattr(self, name, None)  # linear_q_down_proj: only with q_lora_rank
            if linear is not None and getattr(linear, "parallel_mode", "") is None:  # TE "duplicated"
                for param in linear.parameters():
                    param.tensor_model_parallel = False
                    param.partition_dim = -1
        bind = getattr(self.core_attention, "bind_fused_q_norm", None)  # DSA (module docstring)
        if bind is not None:
            up = getattr(self, "linear_q_up_proj", None)
            if up is None or not hasattr(up, "layer_norm_weight") or not isinstance(self.q_layernorm, IdentityOp):
                raise ValueError(
                    "DSA on Transformer Engine needs q_lora_rank and the q norm fused into linear_q_up_proj "
                    "(config.qk_layernorm=True)"
                )
            bind(up)


def use_te_mla_attention(block_spec) -> None:
    """Every MLA layer of ``block_spec`` (in place) builds ``TEMLASelfAttention``."""
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        if attn.module is MLASelfAttention:
            attn.module = TEMLASelfAttention
