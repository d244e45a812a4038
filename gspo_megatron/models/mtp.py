"""The checkpoint's multi-token-prediction (MTP) layer inside the trained Megatron model (``model.mtp``).

The model (``models/mtp_model.py``) holds megatron-core 0.16.1's own MTP block
(``transformer/multi_token_prediction.py``: ``MultiTokenPredictionBlock`` of ``MultiTokenPredictionLayer`` s:
``enorm``, ``hnorm``, ``eh_proj``, the decoder layer's spec as ``transformer_layer``, ``final_layernorm``;
``get_gpt_mtp_block_spec``), inside ``MTPGPTModel``, a GPTModel whose ``_postprocess`` is ours (composed at build, no patch of
megatron's class): megatron's own would compute the MTP loss from ``labels`` and send its gradient into
the main model (DeepSeek-V3's pre-training recipe). Here the MTP layer is the engines' draft, trained on
the rollout's tokens without moving the policy (as slime does):

- the caller asks for the draft's states per forward (``lm_forward(..., drafts=[])``); otherwise the
  MTP block does not run and the forward is the plain GPTModel's, bit for bit;
- asked, the block reads the decoder's output DETACHED and the embedding of the rolled tokens DETACHED
  (``models/mtp_model._DetachedEmbedding``), so a loss on its states reaches the MTP layer's own parameters only
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

from gspo_megatron.models import carried
from gspo_megatron.models.mapping import ColumnParallel, MappingRegistry, Replicated, Rule

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
        ColumnParallel("mtp.layers.*.eh_proj.weight", "model.layers.*.eh_proj.weight", "tp"),
        Replicated("mtp.layers.*.final_layernorm.weight", "model.layers.*.shared_head.norm.weight"),
    ]
    own = [r.moved(r.megatron, n) for r in own]
    moved = [
        r.moved(f"{MTP_PREFIX}*.transformer_layer." + r.megatron[len(_DECODER) :], n)
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
