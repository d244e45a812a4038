"""The checkpoint's multi-token-prediction (MTP) layer inside the trained Megatron model (``model.mtp``).

The model (``models/mtp_model.py``) holds megatron-core 0.16.1's own MTP block
(``transformer/multi_token_prediction.py``: ``MultiTokenPredictionBlock`` of ``MultiTokenPredictionLayer`` s:
``enorm``, ``hnorm``, ``eh_proj``, the decoder layer's spec as ``transformer_layer``, ``final_layernorm``;
``get_gpt_mtp_block_spec``), inside ``MTPGPTModel``, a GPTModel whose ``_postprocess`` is ours (composed at build, no patch of
megatron's class): megatron's own would compute the MTP loss from ``labels`` and send its gradient into
the main model (DeepSeek-V3's pre-training recipe). Here the MTP layer is the engines' draft, trained on
the rollout's tokens without moving the policy (as slime does).

The math of MTP layer k = 1..M (DeepSeek-V3 report 2.2; ``engines/mtp_draft.py`` is the reference on the
HF tensors), with h^0 the main decoder's final (post-norm) states [s, b, H] and t the tokens::

    h^k_i = final_layernorm_k(TransformerLayer_k(eh_proj_k(cat(enorm_k(E[t_{i+k}]), hnorm_k(h^{k-1}_i)))))

causal over i, RoPE at sequence index i (megatron's RoPE reads the index, not ``position_ids``; the
rolled position ids feed a learned position embedding only, which these families lack): so h^k_i is
sglang's draft state for (h_i, t_{i+1}) at position i, and ``h^k_i W^T`` predicts t_{i+k+1}. Megatron
rolls the token ids left by one per layer (``roll_tensor``; the wrapped-around last position of each
packed sequence gets token 0): the last k positions of each sequence have no target.

- the caller asks for the draft's states per forward (``lm_forward(..., drafts=[])``); otherwise the
  MTP block does not run and the forward is the plain GPTModel's, bit for bit;
- asked, the block reads h^0 DETACHED and the embedding E[t] DETACHED (``models/mtp_model._DetachedEmbedding``), so a
  loss on its states reaches the MTP layer's own parameters only (``enorm``, ``hnorm``, ``eh_proj``,
  ``transformer_layer``, ``final_layernorm``; the caller multiplies the states by the output weight
  detached: ``lm_head.mtp_output_weight``, ``losses/mtp_loss.py``). The detached h^0 is a leaf that
  requires grad (its gradient dropped): with ``model.recompute`` megatron checkpoints the MTP layer, whose
  parameters get a gradient only when an input of the checkpoint requires one;
- h^k [s, b, H] (sequence-parallel scattered) enters the output layer's region as the main states do
  (``lm_head._enter_output_region``: gathered over TP) and is handed over as [b, s, H];
- pipeline parallelism: megatron builds the MTP block on the last stage, with its own copy of the
  embedding (``embedding.word_embeddings.weight``, ``shared_embedding=True``), tied to the first stage's:
  loaded from the same HF tensor, exported once (the first stage's: ``weights.build_export_plan`` keeps
  the lowest owner), checkpointed as one tensor (megatron's ``tie_word_embeddings_state_dict``), and its
  gradient (zero here: its output is detached) all-reduced with the first stage's by
  ``finalize_model_grads``, so both copies take the same step.

Names (``mtp_rules``; where the checkpoint keeps the layer: the family's :class:`MTPNaming`):

- DeepSeek-V3 / GLM-4.5 (:data:`AFTER_DECODER`): megatron ``mtp.layers.{k}.{enorm,hnorm,eh_proj,final_layernorm}
  .weight`` and ``mtp.layers.{k}.transformer_layer.*`` <-> HF ``model.layers.{N+k}.{enorm,hnorm,eh_proj,
  shared_head.norm}.weight`` and the decoder layer's names under ``model.layers.{N+k}.`` (the family's own
  decoder rules with the layer index shifted by N = ``num_hidden_layers``), as sglang 0.5.23's draft loads
  them (``srt/models/deepseek_common/deepseek_weight_loader.py``, ``is_nextn``). The layer's
  ``embed_tokens`` and ``shared_head.head`` stay carried (``models/carried.py``): sglang's draft skips them
  and shares the target's embedding and head (``set_embed_and_head``), as megatron's MTP shares the model's;
- Qwen3-Next / Qwen3.5 (:data:`MTP_BRANCH`): ``mtp.pre_fc_norm_embedding`` (enorm), ``mtp.pre_fc_norm_hidden``
  (hnorm), ``mtp.fc`` (eh_proj), ``mtp.norm`` (final_layernorm) and the decoder layer under ``mtp.layers.{k}.``
  (the family's decoder rules, index not shifted), as sglang 0.5.23's ``Qwen3NextForCausalLMMTP``
  (``srt/models/qwen3_next_mtp.py``, through ``Qwen3NextForCausalLM.load_weights(is_mtp=True)``: ``mtp.fc`` ->
  ``fc``, ``mtp.layers`` -> ``model.layers``) loads them. Its decoder layer is full attention (sglang builds
  it with ``full_attention_interval = 1``) with routed experts: the family adapts megatron's MTP layer spec
  (``ModelFamily.adapt_mtp_layer_spec``). Its norms are zero-centered as the decoder's.

Refused (:func:`mtp_errors`, one line each): a family whose MTP layer is not built here, a checkpoint
without one, more than one (sglang 0.5.23's NextN loader asserts ``num_nextn_predict_layers == 1``), a
MoE checkpoint whose last decoder layer is dense (megatron builds the MTP layer from the last layer's
spec); layouts (:func:`mtp_layout_errors`): context parallelism, a tied embedding with pipeline
parallelism.
"""

from __future__ import annotations

from gspo_megatron.models import carried
from gspo_megatron.models.mapping import ColumnParallel, MappingRegistry, Replicated, Rule
from gspo_megatron.models.mtp_naming import AFTER_DECODER, MTP_BRANCH, MTPNaming

__all__ = ["AFTER_DECODER", "MTP_BRANCH", "MTPNaming", "mtp_errors", "mtp_layout_errors", "mtp_naming", "mtp_rules"]

MTP_PREFIX = "mtp.layers."
_DECODER = "decoder.layers.*."
_HF_LAYER = "layers.*."  # the end of a decoder rule's HF prefix (model.layers.*. / model.language_model.layers.*.)


def mtp_naming(hf: dict) -> MTPNaming:
    """The :class:`MTPNaming` of the checkpoint with config.json ``hf`` (its family's ``mtp_naming``)."""
    from gspo_megatron.models.registry import get_family

    return get_family(hf).mtp_naming


def mtp_errors(hf: dict, trained: bool = True) -> list[str]:
    """Why the MTP layer of the checkpoint with config.json ``hf`` cannot be the trained and synced
    draft (``trained``: ``model.mtp``), or the engines' published draft (``trained=False``: only a
    checkpoint without one is refused) (one line each, naming the config.json field or the family;
    empty: it can). The caller prefixes the setting that asks for it (``model.mtp: ...``)."""
    from gspo_megatron.models.family import moe_layer_pattern
    from gspo_megatron.models.registry import families, get_family

    family = get_family(hf)
    m = carried.mtp_layers(hf)
    none = f"config.json declares no MTP layer ({'/'.join(carried.COUNT_FIELDS)} = 0)"
    published = sorted(k for k, v in family.published.items() if carried.mtp_layers(v))
    if not family.sglang_draft_modules and not m:
        if published:
            return [
                f"{none}, and the {family.name} family's MTP layers are not built here yet (its published "
                f"checkpoints have them: {', '.join(published)})"
            ]
        return [f"the {family.name} family has no MTP layers (no draft for speculative decoding)"]
    if not trained:
        return [] if m else [none]
    if not family.mtp_trainable:
        built = ", ".join(sorted(f.name for f in families() if f.mtp_trainable))
        return [
            f"the {family.name} family's MTP layers are not built into the Megatron model here yet "
            f"(only {built}); set model.mtp=false (the engines keep the checkpoint's draft)"
        ]
    if m == 0:
        return [f"{none}: the checkpoint has no draft"]
    if m != 1:
        return [
            f"config.json declares {m} MTP layers; sglang 0.5.23 serves exactly 1 "
            f"({family.mtp_naming.loader} loads one)"
        ]
    n, dense = int(hf.get("num_hidden_layers") or 0), int(hf.get("first_k_dense_replace") or 0)
    if family.is_moe(hf) and dense >= n:
        return [
            f"config.json first_k_dense_replace={dense} >= num_hidden_layers={n}: the checkpoint's MTP layer has "
            "routed experts but megatron builds it as the last decoder layer (dense)"
        ]
    if family.is_moe(hf) and not moe_layer_pattern(hf)[-1]:
        return [
            f"config.json mlp_only_layers={list(hf.get('mlp_only_layers') or [])} / decoder_sparse_step="
            f"{hf.get('decoder_sparse_step') or 1} make the last decoder layer dense: the checkpoint's MTP layer "
            "has routed experts but megatron builds it as the last decoder layer"
        ]
    return []


def mtp_layout_errors(pp: int, cp: int, hf: dict | None = None) -> list[str]:
    """The layouts the MTP layer is not built for here (one line each): context parallelism (megatron's
    MTP rolls the tokens across CP ranks with CUDA tensors; CP needs Transformer Engine anyway), and with
    ``hf`` a tied embedding under pipeline parallelism (the MTP stage's copy of the embedding would be
    the output weight there too; megatron keeps an unused ``output_layer.weight`` beside it).
    Pipeline parallelism itself is supported: megatron builds the MTP block on the last stage with its
    own copy of the embedding, tied to the first stage's (module docstring)."""
    out = []
    if cp > 1:
        out.append(
            f"model.mtp=true needs parallel.cp=1 (got {cp}): the MTP layer is not built with context parallelism here"
        )
    if pp > 1 and hf is not None and hf.get("tie_word_embeddings", False):
        out.append(
            f"model.mtp=true with config.json tie_word_embeddings=true needs parallel.pp=1 (got {pp}): the MTP "
            "stage's embedding copy would also be its output weight"
        )
    return out


def mtp_rules(registry: MappingRegistry, hf: dict) -> MappingRegistry:
    """``registry`` plus the MTP layer's rules (module docstring): its own four tensors and every
    decoder-layer rule moved under ``mtp.layers.*.transformer_layer.``, its HF names under the family's
    :class:`MTPNaming` prefix (the layer index + N where the layer continues ``model.layers``)."""
    naming = mtp_naming(hf)
    shift = naming.index(hf)  # MTP layer 0's HF index: N after the decoder, 0 in an mtp.* branch
    p = {key: name.replace("{i}", "*") for key, name in naming.own_patterns().items()}
    own: list[Rule] = [
        Replicated("mtp.layers.*.enorm.weight", p["enorm.weight"]),
        Replicated("mtp.layers.*.hnorm.weight", p["hnorm.weight"]),
        ColumnParallel("mtp.layers.*.eh_proj.weight", p["eh_proj.weight"], "tp"),
        Replicated("mtp.layers.*.final_layernorm.weight", p["final_layernorm.weight"]),
    ]
    own = [r.moved(r.megatron, shift) for r in own]
    layer = naming.layer.replace("{i}", "*")
    moved = [
        r.moved(
            f"{MTP_PREFIX}*.transformer_layer." + r.megatron[len(_DECODER) :],
            shift,
            tuple(layer + h[h.index(_HF_LAYER) + len(_HF_LAYER) :] for h in r.hf),
        )
        for r in registry.rules
        if r.megatron.startswith(_DECODER)
    ]
    return MappingRegistry(registry.rules + own + moved, registry.fuse_groups)


def model_mapping(model) -> MappingRegistry:
    """The mapping of one GPTModel chunk: its family's, plus :func:`mtp_rules` when it holds the MTP
    block (``model.mtp``)."""
    from gspo_megatron.models.registry import get_family

    registry = get_family(model.hf_config).mapping(model.hf_config)
    return mtp_rules(registry, model.hf_config) if getattr(model, "mtp_process", False) else registry
