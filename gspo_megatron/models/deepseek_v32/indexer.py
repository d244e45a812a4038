"""DeepSeek Sparse Attention (DSA) on Megatron-Core's local spec: the lightning indexer and the sparse
MLA core attention, computing what transformers 5.23's ``DeepseekV32Indexer`` / ``DeepseekV32Attention``
compute (``models/deepseek_v32/modeling_deepseek_v32.py``; GLM-5's ``glm_moe_dsa`` is the same code).

Indexer, per sequence of L tokens (x [L, hidden] the attention input, qr [L, q_lora_rank] =
``q_a_layernorm(q_a_proj(x))``, H = ``index_n_heads``, D = ``index_head_dim``, R = ``qk_rope_head_dim``)::

    q = wq_b(qr).view(L, H, D);  k = LayerNorm_eps1e-6(wk(x))  [L, D]
    RoPE (rotate-half, NOT interleaved; cos/sin of MLA's rotary incl. YaRN's mscale) on the FIRST R dims
    scores[s, h, t] = relu(q[s, h] . k[t] * D^-0.5)                   fp32: [L, H, L]
    w[s, h]         = weights_proj(x)[s, h] * H^-0.5                   fp32 (weights_proj kept in fp32)
    index[s, t]     = sum_h w[s, h] * scores[s, h, t]  (a [1, H] @ [H, L] matmul per query)
    index[s, t]     = -inf for t > s (causal);  selected(s) = topk(index[s, :], min(index_topk, L))
    attention: MLA's softmax over the keys t <= s that are selected (everything else masked)

The operations, their fp32 dtype, their order and the shapes of the matmuls and of the ``topk`` call are
transformers' (a batch of one sequence, a row of L keys per query). **Tie rule**: the keys tied at the
k-th largest score are chosen by ``torch.topk`` itself, on a row of the same length holding the same
fp32 values in the same places, i.e. exactly as transformers' forward chooses them for that sequence on
the same device (ATen's CPU kernel: ``std::nth_element`` / ``partial_sort``, an order that depends on
the row length, the values and k, not "earliest first"; CUDA's: the values above the k-th, then the
tied ones in index order). Exact ties are real: a key whose q.k is negative for every head scores
exactly 0 after the ReLU. Since the CPU order depends on the row length, the indexer always runs on a
sequence alone, on exactly its own L tokens (the reference: transformers' forward of that sequence
unpadded): each ``cu_seqlens`` segment of a packed (THD) row is one sequence of its own length, with
positions restarting at 0, so no query selects (or attends to) a key of another packed sequence; each
row of a right-padded micro-batch is cut to its sequence length, read from the key-padding mask the
trainer passes (``trainer.micro_batches.row_padding_mask``: [b, 1, 1, s], True at padding; without a
mask a row is one sequence of the row's full length); padding queries attend causally (their outputs
are never used; real queries never see padding keys). Every forward of the trainer (training step,
old / reference log-probs, scorer, sync probe) builds its micro-batches with ``collate`` (padded, with
``seq_lens``) or ``collate_packed``, so the selection is transformers' in every layout. TP/EP/PP: every TP rank computes the same selection from the same
(sequence-parallel-gathered) inputs; the indexer weights are replicated.

The indexer is not trained: transformers runs it under ``no_grad`` and top-k has no gradient, so the
policy loss gives it none; its parameters are frozen (``requires_grad=False``: no weight decay moves
them) and travel unchanged through export and weight sync. Megatron-Core 0.16.1's own ``DSAttention``
is not used: it needs the GPU-only Hadamard kernel (bf16 only), applies RoPE to the last dims
interleaved-style, folds the scales in another order (other ties), refuses packed sequences and
computes the indexer KL loss [b, heads, s, s] on every training forward. Its parameter names are kept
(``indexer.linear_wq_b`` / ``linear_wk`` / ``k_norm`` / ``linear_weights_proj``).

Shared layers (GLM-5's ``indexer_types``, ``config.dsa_indexer_types`` of :class:`DSAMLAConfig`): a
``"shared"`` layer has no indexer (no parameters, as in transformers' ``GlmMoeDsaAttention``:
``indexer = None if skip_topk``, and in sglang's checkpoint and loader) and attends with the selection
of the last full layer before it, made in the same forward. transformers carries that layer's top-k
indices [B, S, topk] through the decoder (``GlmMoeDsaModel.forward``'s ``prev_topk_indices``) and every
layer turns them into its mask the same way (index_mask & the causal mask), so carrying the full
layer's ``keep`` (already & causal; per packed segment, per padded row, replay applied) is the same
selection in every layout. With a replay (r3) the full layer's is the engine's selection, which its
shared layers then use, as sglang's do (``forward_mla.py``: ``prev_topk_indices``, captured again as
the shared layer's own ``indexer_topk`` by ``maybe_capture_indexer_topk``: the same keys), so a shared
layer's own replay slot is not read. The carry lives for one forward within a pipeline stage
(:class:`SelectionCarry`): a stage may not start on a shared layer (``glm_moe_dsa.check_layout``) and a
shared layer is not recomputed (:func:`shared_source` refuses ``model.recompute``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import MLATransformerConfig

from gspo_megatron.models.deepseek_v3.local_attention import MLALocalDotProductAttention
from gspo_megatron.models.packed_attention import PackedAttentionMixin, packed_bounds

# largest fp32 [queries, heads, keys] score block the indexer materializes at once (elements): queries
# are taken in chunks below it (each query's row is computed alone: chunking changes no value's maths)
SCORE_BLOCK = 1 << 28


@dataclass
class DSAMLAConfig(MLATransformerConfig):
    """Megatron-Core's MLA config plus the per-layer indexer kind: ``dsa_indexer_types`` (0-based,
    ``"full"`` / ``"shared"``; None: every layer full)."""

    dsa_indexer_types: list[str] | None = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class LightningIndexer(MegatronModule):
    interleaved_rope = False  # GLM-5's indexer: interleaved RoPE (``_rope``)

    """The DSA indexer (module docstring). Parameters (replicated over TP, frozen):
    ``linear_wq_b`` [H*D, q_lora_rank], ``linear_wk`` [D, hidden], ``k_norm`` (LayerNorm D, weight and
    bias), ``linear_weights_proj`` [H, hidden] (fp32, as transformers keeps it)."""

    def __init__(self, config):
        super().__init__(config=config)
        from megatron.core.models.common.embeddings import RotaryEmbedding, YarnRotaryEmbedding

        c = config
        self.n_heads, self.head_dim, self.topk = c.dsa_indexer_n_heads, c.dsa_indexer_head_dim, c.dsa_indexer_topk
        self.rope_dim = c.qk_pos_emb_head_dim
        dtype = c.params_dtype
        self.linear_wq_b = torch.nn.Linear(c.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.linear_wk = torch.nn.Linear(c.hidden_size, self.head_dim, bias=False, dtype=dtype)
        self.k_norm = torch.nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.linear_weights_proj = torch.nn.Linear(c.hidden_size, self.n_heads, bias=False, dtype=torch.float32)
        for p in self.parameters():
            p.requires_grad_(False)
        if c.rope_type == "yarn":
            self.rotary = YarnRotaryEmbedding(
                self.rope_dim,
                rotary_base=c.rotary_base,
                scaling_factor=c.rotary_scaling_factor,
                original_max_position_embeddings=c.original_max_position_embeddings,
                beta_fast=c.beta_fast,
                beta_slow=c.beta_slow,
                mscale=c.mscale,
                mscale_all_dim=c.mscale_all_dim,
            )
        else:
            self.rotary = RotaryEmbedding(self.rope_dim, rotary_percent=1.0, rotary_base=c.rotary_base)

    def _cos_sin(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, R] of positions 0..n-1: transformers' ``cat(freqs, freqs).cos() * attention_scaling``."""
        out = self.rotary(n)
        emb, mscale = out if isinstance(out, tuple) else (out, 1.0)
        emb = emb.reshape(n, -1).to(device)
        return emb.cos() * mscale, emb.sin() * mscale

    def _rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the first R dims of t [L, *, D] (cos/sin [L, R] = cat(freqs, freqs)); the rest passes.
        Rotate-half (DeepSeek-V3.2): ``rot * cos + rotate_half(rot) * sin``. Interleaved (GLM-5,
        ``interleaved_rope``), transformers' ``apply_rotary_pos_emb_interleave``: pairs (x0, x1), (x2, x3)...
        with e = x[0::2], o = x[1::2], c/s the first R/2 columns: ``cat(e*c - o*s, o*c + e*s)`` (the output
        de-interleaved, as transformers lays it before the scores' dot products)."""
        rot, rest = t[..., : self.rope_dim], t[..., self.rope_dim :]
        if self.interleaved_rope:
            cos, sin = cos[:, : cos.shape[1] // 2], sin[:, : sin.shape[1] // 2]
        shape = (cos.shape[0],) + (1,) * (t.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.to(t.dtype).view(shape), sin.to(t.dtype).view(shape)
        if self.interleaved_rope:
            e, o = rot[..., 0::2], rot[..., 1::2]
            return torch.cat([e * cos - o * sin, o * cos + e * sin, rest], dim=-1)
        return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)

    @torch.no_grad()
    def select(
        self, x: torch.Tensor, qr: torch.Tensor, replay: torch.Tensor | None = None, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One sequence: x [L, hidden], qr [L, q_lora_rank] -> keep [L, L] bool, True where query s
        attends key t (t <= s and t among the top-k of row s). replay: the engine's selection to use
        instead (routing replay r3), int [L, index_topk] of key positions, -1 filler; a row with no key
        (all -1: padding, the last token) keeps its own; a key outside [0, s] is refused. counts: int64
        [2] (with replay) that gets += (replayed queries whose own selection equals the engine's, replayed
        queries): ``rollout/indexer_agreement``."""
        n = x.shape[0]
        cos, sin = self._cos_sin(n, x.device)
        q = self._rope(self.linear_wq_b(qr).view(n, self.n_heads, self.head_dim), cos, sin)
        k = self._rope(self.k_norm(self.linear_wk(x)), cos, sin)  # [L, D]
        w = self.linear_weights_proj(x.to(torch.float32)).float() * (self.n_heads**-0.5)  # [L, H]
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril_()
        kt = k.transpose(-1, -2).float().unsqueeze(0).unsqueeze(1)  # [1, 1, D, L]
        keep = torch.zeros(n, n, dtype=torch.bool, device=x.device)
        chunk = max(1, SCORE_BLOCK // max(1, self.n_heads * n))
        topk = min(self.topk, n)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            scores = F.relu(torch.matmul(q[a:b].float().unsqueeze(0), kt) * self.head_dim**-0.5)  # [1, c, H, L]
            index = torch.matmul(w[a:b].unsqueeze(0).unsqueeze(-2), scores).squeeze(-2)  # [1, c, L]
            index = index.masked_fill(~causal[a:b], float("-inf"))
            keep[a:b].scatter_(-1, index.topk(topk, dim=-1).indices[0], True)
        keep &= causal
        if replay is not None:
            keep = replayed_keep(keep, replay, counts)
        return keep


def replayed_keep(keep: torch.Tensor, replay: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """keep [L, L] bool (the indexer's own selection) with each row that ``replay`` [L, K] (key
    positions, -1 filler) gives keys for replaced by those keys; ValueError on a key outside [0, s]
    of its row s (a selection laid on the wrong tokens). counts: int64 [2] that gets += (replaced rows
    whose own selection was the same set, replaced rows)."""
    n = keep.shape[0]
    replay = replay.to(device=keep.device, dtype=torch.long)
    if replay.dim() != 2 or replay.shape[0] != n:
        raise ValueError(f"indexer replay: selection of shape {tuple(replay.shape)} for a sequence of {n} tokens")
    rows = (replay >= 0).any(-1)
    if not bool(rows.any()):
        return keep
    bad = (replay < -1) | (replay > torch.arange(n, device=keep.device).view(n, 1))
    if bool(bad.any()):
        s = int(bad.any(-1).nonzero()[0, 0])
        raise ValueError(
            f"indexer replay: query {s} of a {n}-token sequence is given keys {replay[s].tolist()} outside "
            f"[0, {s}] (indexer_topk laid on the wrong tokens?)"
        )
    given = torch.zeros(n, n + 1, dtype=torch.bool, device=keep.device)
    given.scatter_(-1, torch.where(replay >= 0, replay, n), True)
    if counts is not None:
        same = (keep == given[:, :n]).all(-1) & rows
        counts += torch.stack([same.sum(), rows.sum()]).to(device=counts.device, dtype=counts.dtype)
    return torch.where(rows.view(n, 1), given[:, :n], keep)


def shared_source(config, layer_number: int) -> int | None:
    """For a "shared" layer of ``config.dsa_indexer_types`` (0-based list of "full" / "shared"; absent
    or None: every layer full), the 1-based number of the full layer whose selection it reuses (the
    last full one before it); None for a full layer. ValueError for a shared layer with no full layer
    before it, or (``model.recompute``) a recomputed shared layer (its selection is carried within one
    forward only: the recompute in backward would not find it)."""
    types = getattr(config, "dsa_indexer_types", None)
    if not types or types[layer_number - 1] != "shared":
        return None
    full = [i for i in range(layer_number - 1) if types[i] == "full"]
    if not full:
        raise ValueError(
            f"config.json indexer_types: layer {layer_number - 1} is 'shared' with no 'full' layer before it"
        )
    if config.recompute_granularity is not None:
        raise ValueError(
            f"model.recompute=true is not supported with config.json indexer_types 'shared' layers (layer "
            f"{layer_number - 1}): the recomputed layer would not see layer {full[-1]}'s selection, which is "
            "carried within one forward only; set model.recompute=false"
        )
    return full[-1] + 1


def _batch_key(attention_mask, packed_seq_params, query) -> tuple:
    """What identifies one forward's micro-batch to every layer of it: the very mask / packing objects
    Megatron's TransformerBlock hands each layer, and the query's leading dims."""
    return (attention_mask, packed_seq_params, tuple(query.shape[:2]))


class SelectionCarry:
    """The selection a full DSA layer made in the running forward, for the "shared" layers right after
    it (transformers' ``GlmMoeDsaModel.forward``: ``prev_topk_indices``, returned unchanged by a shared
    layer). Layers of one pipeline stage run one after the other within a forward, so one slot per
    process serves every model: a full layer followed by a shared one puts (itself, the micro-batch,
    the selection); a shared layer takes it only from its own source layer of the same model and
    micro-batch (a RuntimeError otherwise, never another selection), and the last shared layer of the
    run clears the slot."""

    def __init__(self) -> None:
        self.config: object | None = None  # the model's TransformerConfig (one object per built model)
        self.layer = 0  # the full layer's 1-based number
        self.key: tuple | None = None  # _batch_key of the micro-batch
        self.selection: object | None = None  # DSALocalAttention._select's form

    def clear(self) -> None:
        self.config, self.layer, self.key, self.selection = None, 0, None, None

    def put(self, att, key: tuple, selection) -> None:
        if _next_is_shared(att):
            self.config, self.layer, self.key, self.selection = att.config, att.layer_number, key, selection

    def take(self, att, key: tuple):
        ok = (
            self.config is att.config
            and self.layer == att.source_layer
            and self.key is not None
            and all(a is b for a, b in zip(self.key[:2], key[:2]))
            and self.key[2] == key[2]
        )
        if not ok:
            raise RuntimeError(
                f"DSA layer {att.layer_number - 1} ('shared' in indexer_types) found no selection of layer "
                f"{att.source_layer - 1} from this forward (that layer must run before it in the same stage)"
            )
        selection = self.selection
        if not _next_is_shared(att):
            self.clear()
        return selection


def _next_is_shared(att) -> bool:
    types = getattr(att.config, "dsa_indexer_types", None) or []
    return att.layer_number < len(types) and types[att.layer_number] == "shared"


CARRY = SelectionCarry()


class DSALocalAttention(PackedAttentionMixin, MLALocalDotProductAttention):
    """MLA's local core attention restricted to the indexer's selection (module docstring). Takes
    MLA's extra ``x`` (the attention input, [s, b, hidden], [s/tp, b, hidden] with sequence parallel)
    and ``qr`` (``q_layernorm(q_down(x))``, same layout; [t, q_lora_rank] packed; on Transformer
    Engine's spec ``q_down(x)``, normalized here: :meth:`bind_fused_q_norm`); query/key/value
    [s, b, heads, dim] (packed THD: [t, heads, dim]). Output as the local attention's: [s, b, heads*v]
    ([t, 1, heads*v] packed). Already packed-capable: ``use_packed_local_attention`` leaves it alone."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        # "shared" layers (``config.dsa_indexer_types``, GLM-5): no indexer, no parameters; they reuse
        # the selection of ``self.source_layer`` (module docstring, "Shared layers")
        self.source_layer = shared_source(config, self.layer_number)
        self.indexer = self.indexer_class(config) if self.source_layer is None else None
        # routing replay (r3, ``trainer/route_replay.py``): the engine's selection of this layer for the
        # next forward, int64 [b, s, index_topk] (packed: [1, t, index_topk]) of key positions within
        # each sequence, -1 where none; None: the indexer selects itself
        self.indexer_replay: torch.Tensor | None = None
        # with a replay: int64 [2] (queries whose own selection equals the engine's, replayed queries)
        # summed over the forward's sequences; read and cleared by ``trainer/route_replay.RouteReplay``
        self.indexer_counts: torch.Tensor | None = None
        # Transformer Engine's spec: the q RMSNorm fused into linear_q_up_proj (bind_fused_q_norm)
        self.q_norm: Callable[[torch.Tensor], torch.Tensor] | None = None

    def bind_fused_q_norm(self, linear) -> None:
        """On Transformer Engine's spec MLA's ``q_layernorm`` is an IdentityOp and the q RMSNorm is
        fused into ``linear`` (``linear_q_up_proj``, TE ``LayerNormLinear``), so MLA hands this core
        attention ``qr = q_a_proj(x)`` unnormalized; the indexer then normalizes it with
        :func:`fused_rms_norm` of ``linear`` (transformers' ``q_resid = q_a_layernorm(q_a_proj(x))``).
        ``linear`` is kept in a partial (not a submodule: its parameters stay MLA's)."""
        self.q_norm = functools.partial(fused_rms_norm, linear)

    indexer_class = LightningIndexer

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The local attention's (its softmax offset, if any) plus the indexer's (replicated tensors):
        ``DotProductAttention.sharded_state_dict`` does not recurse into submodules."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.indexer is not None:
            out.update(self.indexer.sharded_state_dict(f"{prefix}indexer.", sharded_offsets, metadata))
        return out

    def _full(self, t: torch.Tensor) -> torch.Tensor:
        if self.config.sequence_parallel and self.config.tensor_model_parallel_size > 1:
            return gather_from_sequence_parallel_region(t)
        return t

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        x=None,
        qr=None,
    ):
        if x is None or qr is None:
            raise ValueError("DSA core attention needs MLA's x and qr (config.experimental_attention_variant='dsa')")
        if self.indexer is None:  # a "shared" layer: the selection of its source layer in this forward
            selection = CARRY.take(self, _batch_key(attention_mask, packed_seq_params, query))
        else:
            selection = self._select(x, qr, attention_mask, packed_seq_params, query.shape[0])
            CARRY.put(self, _batch_key(attention_mask, packed_seq_params, query), selection)
        return self._attend(query, key, value, selection, packed_seq_params, attn_mask_type, attention_bias)

    def _select(self, x, qr, attention_mask, packed_seq_params, tokens: int):
        """This layer's selection (its indexer, or the engine's with a replay): padded [s, b]: keep
        [b, s, s] bool (padding queries causal); packed [t]: [(a, b, keep [b - a, b - a])] per non-empty
        ``cu_seqlens`` segment."""
        indexer = self.indexer
        if indexer is None:
            raise RuntimeError(f"DSA layer {self.layer_number - 1} is 'shared': it has no indexer to select with")
        with torch.no_grad():
            x, qr = self._full(x.detach()), self._full(qr.detach())
            if self.q_norm is not None:  # TE spec: q_a_proj(x) -> q_a_layernorm (bind_fused_q_norm)
                qr = self.q_norm(qr)
        replay = self.indexer_replay  # routing replay (r3): [b, s, index_topk] or None
        counts = None
        if replay is not None:
            if self.indexer_counts is None:
                self.indexer_counts = torch.zeros(2, dtype=torch.int64, device=x.device)
            counts = self.indexer_counts
        if packed_seq_params is None:
            x, qr = x.transpose(0, 1), qr.transpose(0, 1)  # [b, s, *]
            b, s = x.shape[:2]
            lens = row_lengths(attention_mask, b, s)
            if replay is not None and tuple(replay.shape[:2]) != (b, s):
                raise ValueError(f"indexer replay: selection {tuple(replay.shape)} for a [b, s] = {[b, s]} micro-batch")
            keep = torch.ones(b, s, s, dtype=torch.bool, device=x.device).tril_()  # padding queries: causal
            for i, n in enumerate(lens):
                keep[i, :n, :n] = indexer.select(x[i, :n], qr[i, :n], None if replay is None else replay[i, :n], counts)
            return keep
        cu = packed_bounds(packed_seq_params, tokens)
        x, qr = x.reshape(x.shape[0], -1), qr.reshape(qr.shape[0], -1)  # [t, hidden], [t, q_lora_rank]
        if replay is not None and tuple(replay.shape[:2]) != (1, tokens):
            raise ValueError(f"indexer replay: selection {tuple(replay.shape)} for a packed row of {tokens} tokens")
        return [
            (a, b, indexer.select(x[a:b], qr[a:b], None if replay is None else replay[0, a:b], counts))
            for a, b in zip(cu[:-1], cu[1:])
            if b > a
        ]

    def _attend(self, query, key, value, selection, packed_seq_params, attn_mask_type, attention_bias):
        """MLA's local attention restricted to ``selection`` (:meth:`_select`'s form)."""
        dense = MLALocalDotProductAttention.forward
        if packed_seq_params is None:
            return dense(
                self,
                query,
                key,
                value,
                ~selection.unsqueeze(1),
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
            )
        outs = [
            dense(
                self,
                query[a:b].unsqueeze(1),
                key[a:b].unsqueeze(1),
                value[a:b].unsqueeze(1),
                ~keep[None, None],
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
            )
            for a, b, keep in selection
        ]
        return torch.cat(outs, dim=0)  # [t, 1, heads*v]


def fused_rms_norm(linear, x: torch.Tensor) -> torch.Tensor:
    """The RMSNorm that Transformer Engine's ``LayerNormLinear`` ``linear`` fuses before its GEMM, of
    x [..., in_features]: in fp32, as TE's reference (transformer_engine/pytorch/ops/basic/rmsnorm.py,
    ``op_onnx_forward``; the CUDA kernel computes in fp32 too) ``x * rsqrt(mean(x^2) + eps) * gamma``,
    gamma = ``layer_norm_weight`` (+1 with ``zero_centered_gamma``), eps = ``linear.eps``; cast back to
    x's dtype. In fp32 this is bitwise transformers' ``DeepseekV32RMSNorm`` given the same eps."""
    if getattr(linear, "normalization", "RMSNorm") != "RMSNorm":
        raise ValueError(
            f"DSA on Transformer Engine: linear_q_up_proj normalization {linear.normalization!r}, needs RMSNorm"
        )
    w = linear.layer_norm_weight.float()
    if getattr(linear, "zero_centered_gamma", False):
        w = w + 1
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + linear.eps) * w).to(x.dtype)


def row_lengths(attention_mask: torch.Tensor | None, b: int, s: int) -> list[int]:
    """Each row's sequence length from the trainer's key-padding mask ``attention_mask`` [b, 1, 1, s]
    bool (True at right padding; ``trainer.micro_batches.row_padding_mask``); None: every row is one
    sequence of s tokens. Refuses any other mask (a causal [.., s, s] one carries no lengths)."""
    if attention_mask is None:
        return [s] * b
    if tuple(attention_mask.shape) != (b, 1, 1, s) or attention_mask.dtype != torch.bool:
        raise ValueError(
            f"DSA attention_mask must be a bool key-padding mask [b, 1, 1, s] = {[b, 1, 1, s]}, got "
            f"{attention_mask.dtype} {list(attention_mask.shape)}"
        )
    pad = attention_mask.reshape(b, s)
    lens = (s - pad.sum(-1)).tolist()
    if not torch.equal(
        pad, torch.arange(s, device=pad.device).view(1, s) >= pad.new_tensor(lens, dtype=torch.long).view(b, 1)
    ):
        raise ValueError("DSA attention_mask must mark right padding only (True from each row's length on)")
    if min(lens) < 1:
        raise ValueError("DSA attention_mask leaves a row with no token")
    return lens


class InterleavedLightningIndexer(LightningIndexer):
    """GLM-5's indexer (transformers' ``GlmMoeDsaIndexer``): interleaved RoPE, otherwise the same."""

    interleaved_rope = True


class InterleavedDSALocalAttention(DSALocalAttention):
    indexer_class = InterleavedLightningIndexer


def use_dsa_attention(block_spec, cls: type = DSALocalAttention) -> int:
    """Every MLA layer's core attention of ``block_spec`` becomes ``cls`` (:class:`DSALocalAttention`,
    or GLM-5's :class:`InterleavedDSALocalAttention`) in place: the local spec's
    ``MLALocalDotProductAttention`` (after ``use_local_mla_attention``) or Transformer Engine's
    ``TEDotProductAttention`` (after ``te_attention.use_te_mla_attention``, whose ``TEMLASelfAttention``
    binds the fused q norm). Returns how many."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    n = 0
    for layer in block_spec.layer_specs:
        attn = layer.submodules.self_attention
        module = attn.module
        if isinstance(module, type) and issubclass(module, MLASelfAttention):
            attn.submodules.core_attention = cls
            n += 1
    return n
