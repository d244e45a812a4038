"""Megatron-Core 0.16.1's local (non-TE) ``DotProductAttention`` does not accept the ``k_channels`` /
``v_channels`` arguments that ``MLASelfAttention`` passes, so MLA cannot be built on the local spec
as shipped. ``MLALocalDotProductAttention`` accepts them: the local kernel already handles a key
width (nope + rope) different from the value width, given that ``config.kv_channels`` is the value
head dim (it sizes the output) and the softmax scale comes from MLA (``softmax_scale``, with YaRN's
mscale; the generic Attention constructor first builds one without it, which MLA then replaces).
Without Transformer Engine the MLA module also misreads TE as present (``HAVE_TE``); corrected here. ``use_local_mla_attention(block_spec)`` puts it into every MLA layer of a decoder block spec.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention


class MLALocalDotProductAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"MLA local attention needs config.kv_channels == v_head_dim "
                             f"({config.kv_channels} != {v_channels})")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout,
                         softmax_scale, cp_comm_type, pg_collection)


def use_local_mla_attention(block_spec) -> None:
    """Swap the local core attention of every MLA layer in ``block_spec`` (in place)."""
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if not isinstance(mla.TELinear, type):
        # Without Transformer Engine Megatron's TE extension hands out mock classes, yet the module
        # believes it has TE and calls isinstance(linear_proj, TELinear): correct the flag.
        mla.HAVE_TE = False
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        if attn.module is MLASelfAttention and attn.submodules.core_attention is DotProductAttention:
            attn.submodules.core_attention = MLALocalDotProductAttention
