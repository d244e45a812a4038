"""What a model family is: everything the code needs to know about one HF architecture.

A family is one folder under ``models/`` (``qwen3_moe/``, ``mixtral/``, ...) holding one
``ModelFamily`` subclass registered with ``@register_family``. It owns
- the HF ``model_type``s and model classes it accepts, and the features it refuses (``check``);
- HF config -> Megatron-Core config (``config_fields``: ``TransformerConfig`` kwargs that come from
  the model; ``rotary_kwargs``: GPTModel's position-embedding arguments);
- the declarative weight mapping (``mapping``), assembled from the helpers in ``rules.py``, with its
  fuse groups (``mapping.FuseGroup``: HF tensors the engine fuses only when they arrive in one
  ``load_weights`` call, kept in one sync bucket; DeepSeek's ``q_a_proj`` + ``kv_a_proj_with_mqa``);
- the dimensions the planner needs (``dims``);
- the checkpoint naming of routed experts the CPU engine and the CPU server's sharding need
  (``expert_naming``, or ``stacked_expert_naming`` for experts stacked per layer);
- the HF tensors an FP8 weight sync quantizes (``fp8_modules`` / ``fp8_excluded``), and the modules an
  FP8 engine must keep unquantized (``fp8_engine_unquantized``);
- what sglang 0.5.23's model class for the family builds differently from the config
  (``sglang_ties_lm_head``, ``sglang_every_layer_sparse``; checked by ``sglang_errors``);
- the names the engines look the family up by: the sglang module of each architecture and what its class
  keeps (``sglang_modules``, ``sglang_kept_from_start``, ``sglang_mamba_cache``), the transformers router
  and indexer classes the CPU server hooks (``hf_router_classes``, ``hf_router_perturbable``,
  ``hf_indexer_classes``), a vision-language checkpoint's language model (``language_model_prefix``,
  ``language_model_excluded``);
- a tiny test config (``tiny``: kwargs of transformers' config class) and published configs the
  planner knows by name (``published``).
Every other module asks the family (``gspo_megatron.models.get_family(hf)``) and names no architecture.

``GQAFamily`` implements all of it for the Llama-style decoders (grouped-query attention, RMSNorm,
SwiGLU dense MLP or routed experts with an optional shared expert); a family sets class attributes
and overrides ``config_fields`` / ``check`` for what differs.
"""

from __future__ import annotations

import re

import torch.nn.functional as F

from gspo_megatron.models import hf_config
from gspo_megatron.models.dims import ModelDims
from gspo_megatron.models.mapping import MappingRegistry, Rule
from gspo_megatron.models.mtp_naming import AFTER_DECODER, MTPNaming
from gspo_megatron.models.rules import (
    ExpertNaming,
    StackedExpertNaming,
    attention_dims,
    dense_mlp_rules,
    embedding_rules,
    gqa_attention_rules,
    pre_mlp_norm_rules,
    routed_expert_rules,
    shared_expert_rules,
)

# The big projections of the published FP8 checkpoints (DeepSeek-V3, Qwen3-FP8): quantized on sync.
GQA_FP8_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_EXCLUDED = ("embed_tokens", "lm_head", "norm")


class ModelFamily:
    """Base class of a family; see the module docstring. Subclasses set the class attributes."""

    name: str = ""
    model_types: tuple[str, ...] = ()  # default: (name,)
    architectures: tuple[str, ...] = ()
    expert_naming: ExpertNaming | None = None
    # routed experts stacked per layer in the checkpoint under the names transformers keeps in memory
    # (gpt-oss): the CPU engine loads them by name (no per-expert naming), the CPU server shards them
    stacked_expert_naming: StackedExpertNaming | None = None
    fp8_modules: tuple[str, ...] = ()
    fp8_excluded: tuple[str, ...] = FP8_EXCLUDED
    # modules (under ``model.layers.<i>.``) that an FP8-on-sync engine must build unquantized, listed as
    # ``modules_to_not_convert`` in its quantization_config (sglang's Fp8Config reads it, and gives
    # such a FusedMoE UnquantizedFusedMoEMethod): what the sync sends them is not FP8
    fp8_engine_unquantized: tuple[str, ...] = ()
    # sglang 0.5.23's class ties lm_head to embed_tokens when tie_word_embeddings (qwen2.py, qwen3.py,
    # deepseek_v2.py: ``self.lm_head = self.model.embed_tokens``); False: a separate lm_head parameter,
    # which a tied model's weight sync (no lm_head.weight) never writes
    sglang_ties_lm_head: bool = False
    # sglang 0.5.23's class builds routed experts in every decoder layer, ignoring mlp_only_layers /
    # decoder_sparse_step (qwen2_moe.py / qwen3_moe.py ``stage_facts``: ``is_layer_sparse = True``)
    sglang_every_layer_sparse: bool = False
    # -- the names other packages look the family up by (read there; the engines build their tables
    # from every registered family's, so no module outside ``models/`` names an architecture) ----------
    # HF architecture -> the sglang 0.5.23 module serving it (``sglang/srt/models/<module>.py``, whose
    # ``EntryClass`` lists the class), one entry per ``architectures``: the CPU server imports the class
    # from it (``cpu_server/sglang_models.py``: ``MODULES``), not through sglang's registry
    sglang_modules: dict[str, str] = {}
    # the draft class's architecture -> the sglang 0.5.23 module serving it (``srt/models/<module>.py``,
    # whose ``EntryClass`` lists it): the class sglang builds for the checkpoint's MTP layer in speculative
    # decoding (``ModelConfig(is_draft_model=True)`` renames ``architectures[0]``, e.g.
    # ``Glm4MoeForCausalLM`` -> ``Glm4MoeForCausalLMNextN``, ``srt/configs/model_config.py``); the CPU
    # server builds its draft from it (``cpu_server/sglang_models.py``: ``DRAFT_MODULES``). Empty: the family
    # has no MTP draft here. ``mtp_trainable``: the Megatron model can hold the MTP layer (``model.mtp``,
    # ``models/mtp.py``: its mapping derived from the decoder layer's rules). Neither is inherited (a
    # subclass family, e.g. DeepSeek-V3.2 of DeepSeek-V3, has its own attention and draft class: it
    # declares both itself, ``__init_subclass__``)
    sglang_draft_modules: dict[str, str] = {}
    mtp_trainable: bool = False
    # sglang 0.5.23 defaults ``--speculative-draft-model-path`` to ``--model-path`` for the family's
    # architectures (``arg_groups/speculative_hook.py`` ``_handle_eagle_family``'s list: the DeepSeek and GLM
    # MTP architectures); False: it stays unset and the draft worker reads the model path
    # (``ModelConfig.from_server_args``). Inherited. The CPU server resolves the flag by it
    # (``cpu_server/speculative.py``)
    sglang_draft_path_defaulted: bool = False
    # where the checkpoint keeps its MTP layer (``models/mtp.py``: ``model.layers.{N}.*`` after the decoder, or
    # Qwen3-Next's ``mtp.*`` branch); inherited (a subclass family keeps its parent's checkpoint layout)
    mtp_naming: MTPNaming = AFTER_DECODER
    # HF architecture -> prefixes of parameters of sglang's class that the weight sync never writes (a
    # vision tower the engine keeps from start-up; ``carried_prefixes``): the CPU server neither poisons
    # nor checks them (``KEPT_FROM_START``)
    sglang_kept_from_start: dict[str, tuple[str, ...]] = {}
    # sglang 0.5.23's class keeps a Mamba-style state cache (Gated DeltaNet layers): the CPU server starts
    # it with the cache strategy the CPU platform supports (``LINEAR_ATTENTION_HYBRIDS``)
    sglang_mamba_cache: bool = False
    # transformers' top-k router classes (``forward(h) -> (logits, scores, indices)``) whose choices the
    # CPU server returns as routed experts (``cpu_server/routes.py``: ``ROUTER_CLASSES``); empty: it
    # returns none for this family
    hf_router_classes: tuple[str, ...] = ()
    # whether ``--router-logit-perturbation`` may move those routers' choices (softmax routers); False: a
    # sigmoid router with a bias, recorded as it is (``routes._NO_PERTURB``)
    hf_router_perturbable: bool = True
    # transformers' DSA indexer classes whose selections the CPU server returns as ``indexer_topk``
    # (``routes.INDEXER_CLASSES``)
    hf_indexer_classes: tuple[str, ...] = ()
    # a vision-language checkpoint of the family (config.json with ``text_config``): the prefix its
    # checkpoint keeps the language model's ``model.`` names under, and the name prefixes (checkpoint's
    # and sglang's spelling) that are not the language model; the transformers engine serves the language
    # model alone (``engines/hf_engine.py``: ``LANGUAGE_MODEL_PREFIXES``, ``_NOT_LANGUAGE_MODEL``)
    language_model_prefix: str | None = None
    language_model_excluded: tuple[str, ...] = ()
    tiny: dict = {}
    published: dict[str, dict] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for field, default in (("sglang_draft_modules", {}), ("mtp_trainable", False)):
            if field not in cls.__dict__:  # not inherited (the comment at the fields)
                setattr(cls, field, default)

    @property
    def experts_stacked_in_checkpoint(self) -> bool:
        """True: routed experts are stacked per layer in the checkpoint (``stacked_expert_naming``)."""
        return self.stacked_expert_naming is not None

    def __init__(self):
        if not self.model_types:
            self.model_types = (self.name,)
        self._fp8 = (
            re.compile(r"\.(" + "|".join(map(re.escape, self.fp8_modules)) + r")\.weight$")
            if self.fp8_modules
            else None
        )
        self._fp8_no = re.compile("|".join(map(re.escape, self.fp8_excluded))) if self.fp8_excluded else None

    def __repr__(self) -> str:
        return f"<family {self.name}>"

    # -- what subclasses provide ------------------------------------------------------------------
    def check(self, hf: dict) -> None:
        """Raise ValueError naming a config.json field whose value this family cannot run."""

    def config_fields(self, hf: dict) -> dict:
        """``TransformerConfig`` kwargs that come from the model (not the layout or the run)."""
        raise NotImplementedError

    def check_transformer_impl(self, te: bool) -> None:
        """Raise ValueError when the family cannot run on the chosen layer spec (te: Transformer Engine)."""

    def adapt_layer_spec(self, block_spec, te: bool) -> None:
        """Adjust Megatron's decoder block spec in place (a module Megatron-Core lacks on a spec)."""

    def adapt_mtp_layer_spec(self, layer_spec, te: bool):
        """Megatron's MTP layer spec (``MultiTokenPredictionLayer``, its ``transformer_layer`` the last decoder
        layer's spec after :meth:`adapt_layer_spec`) as the checkpoint's MTP layer is built; returns a new spec
        (the decoder's is shared, never changed). Default: unchanged."""
        return layer_spec

    def randomize_tiny(self, model) -> None:
        """Give a tiny transformers model's family-specific parameters random values where
        transformers initializes them to zeros or near-constants (so tests exercise them)."""

    def tiny_hf_config(self, cfg: dict) -> dict:
        """The config dict transformers builds the tiny model from, given ``tiny`` + overrides (a
        family with a vision-language checkpoint nests the text fields under ``text_config``)."""
        return cfg

    def carried_prefixes(self, hf: dict) -> tuple[str, ...]:
        """HF name prefixes of checkpoint tensors that are not trained and are carried through
        conversion and export unchanged (a vision tower: ``model.visual.``), as the MTP layers are
        (``models/carried.py`` keeps both)."""
        return ()

    def check_layout(self, hf: dict, tp: int, pp: int, ep: int, etp: int | None) -> None:
        """Raise ValueError naming the ``parallel.*`` field of a layout Megatron-Core cannot build for
        this family (beyond divisibility, which ``build.check_layout`` checks)."""

    def tp_divisible(self, hf: dict) -> list[tuple[str, int]]:
        """(what, size) of further dims that tensor parallelism splits (besides heads, vocab, FFN)."""
        return []

    def megatron_config_class(self):
        """The Megatron-Core config class ``config_fields`` are for."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig

    def rotary_kwargs(self, hf: dict) -> dict:
        """GPTModel's position-embedding arguments."""
        return dict(
            position_embedding_type="rope",
            rotary_base=hf_config.rope_theta(hf),
            rotary_percent=hf_config.partial_rotary_factor(hf),
        )

    def mapping(self, hf: dict) -> MappingRegistry:
        raise NotImplementedError

    def dims(self, hf: dict) -> ModelDims:
        raise NotImplementedError

    # -- derived ----------------------------------------------------------------------------------
    def is_moe(self, hf: dict) -> bool:
        return hf_config.num_experts(hf) > 0

    def sglang_errors(self, hf: dict) -> list[str]:
        """One line per feature of ``hf`` that sglang 0.5.23's model class for this family would not
        build as the trainer does (so part of the engine's model would never be written by the sync)."""
        cls = self.architectures[0] if self.architectures else self.name
        e = []
        if hf.get("tie_word_embeddings", False) and not self.sglang_ties_lm_head:
            e.append(
                f"config.json tie_word_embeddings=true is not supported with rollout.engine=sglang for {self.name}: "
                f"sglang's {cls} keeps lm_head apart from embed_tokens and the weight sync of a tied model "
                "sends no lm_head.weight, so the engine's lm_head would never be written; use an untied "
                "checkpoint (tie_word_embeddings: false, with lm_head.weight) or rollout.engine=hf"
            )
        if self.sglang_every_layer_sparse and self.is_moe(hf):
            dense = [i for i, m in enumerate(moe_layer_pattern(hf)) if not m]
            if dense:
                e.append(
                    f"config.json mlp_only_layers={list(hf.get('mlp_only_layers') or [])} / decoder_sparse_step="
                    f"{hf.get('decoder_sparse_step') or 1} (dense layers {dense}) is not supported with "
                    f"rollout.engine=sglang: sglang's {cls} builds routed experts in every layer, so those "
                    "layers' MLPs would never be written by the weight sync; use mlp_only_layers: [] and "
                    "decoder_sparse_step: 1, or rollout.engine=hf"
                )
        return e

    def fp8_quantizes(self, name: str) -> bool:
        """Whether an FP8 weight sync quantizes HF tensor ``name`` (a 2-D weight; the caller checks)."""
        return (
            self._fp8 is not None
            and self._fp8.search(name) is not None
            and not (self._fp8_no is not None and self._fp8_no.search(name))
        )


def moe_layer_pattern(hf: dict) -> list[int]:
    """1 for each layer with routed experts, from ``decoder_sparse_step`` / ``mlp_only_layers``
    (Qwen-MoE) and ``first_k_dense_replace`` (DeepSeek / GLM-MoE)."""
    n = hf_config.get_int(hf, "num_hidden_layers")
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    return [int(i >= first_dense and i not in dense and (i + 1) % step == 0) for i in range(n)]


class GQAFamily(ModelFamily):
    """Llama-style decoder: GQA attention (optional q/k/v bias, optional QK-norm), RMSNorm, SwiGLU
    dense MLP, or routed experts (``expert_naming``) with an optional shared expert."""

    qk_norm: bool = False
    qkv_bias: bool | None = None  # None: from config.json attention_bias (default False)
    attention_bias_on_o_proj: bool = True  # Llama/Qwen3 semantics of attention_bias (refused)
    shared_expert_block: str | None = None  # HF name of the shared expert MLP under the layer
    shared_expert_gate: str | None = None  # HF name of its sigmoid gate weight, if any
    fp8_modules: tuple[str, ...] = GQA_FP8_MODULES

    # -- config -----------------------------------------------------------------------------------
    def has_qk_norm(self, hf: dict) -> bool:
        return self.qk_norm

    def has_qkv_bias(self, hf: dict) -> bool:
        if self.qkv_bias is not None:
            return self.qkv_bias
        return bool(hf.get("attention_bias", False))

    def check(self, hf: dict) -> None:
        kind = hf_config.rope_type(hf)
        if kind not in ("default", "yarn"):
            raise ValueError(
                f"config.json rope type {kind!r} (rope_scaling / rope_parameters) is not "
                f"supported for {self.name} yet (default RoPE and yarn only)"
            )
        if kind == "yarn":
            from gspo_megatron.models.yarn import yarn_fields

            yarn_fields(hf, self.name)  # raises naming what Megatron cannot express
        if self.qkv_bias is None and self.attention_bias_on_o_proj and hf.get("attention_bias"):
            raise ValueError(
                f"config.json attention_bias=true (a bias on q/k/v and o_proj) is not supported for {self.name}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json hidden_act {act!r} is not supported (silu only)")

    def megatron_config_class(self):
        """TransformerConfig plus the ``yarn_*`` fields (``models/yarn.py``; unset: plain RoPE)."""
        from gspo_megatron.models.yarn import YarnTransformerConfig

        return YarnTransformerConfig

    def rotary_kwargs(self, hf: dict) -> dict:
        kwargs = super().rotary_kwargs(hf)
        if hf_config.rope_type(hf) == "yarn":
            kwargs["position_embedding_type"] = "yarn"
        return kwargs

    def config_fields(self, hf: dict) -> dict:
        self.check(hf)
        dims = attention_dims(hf)
        fields = dict(
            num_layers=hf_config.get_int(hf, "num_hidden_layers"),
            hidden_size=hf_config.get_int(hf, "hidden_size"),
            num_attention_heads=dims.num_heads,
            num_query_groups=dims.num_query_groups,
            kv_channels=dims.head_dim,
            ffn_hidden_size=hf.get("intermediate_size"),
            normalization="RMSNorm",
            layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.has_qkv_bias(hf),
            qk_layernorm=self.has_qk_norm(hf),
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
        if self.is_moe(hf):
            fields.update(self.moe_fields(hf))
        if hf_config.rope_type(hf) == "yarn":
            from gspo_megatron.models.yarn import yarn_fields

            fields.update(yarn_fields(hf, self.name))
        return fields

    def moe_ffn_hidden(self, hf: dict) -> int:
        return hf_config.get_int(hf, "moe_intermediate_size")

    def moe_fields(self, hf: dict) -> dict:
        """Routing: softmax over all experts then top-k; with ``norm_topk_prob`` the top-k weights
        are renormalized, which equals Megatron's top-k of the logits then softmax (pre_softmax off)."""
        pattern = moe_layer_pattern(hf)
        fields = dict(
            num_moe_experts=hf_config.num_experts(hf),
            moe_router_topk=hf_config.get_int(hf, "num_experts_per_tok"),
            moe_ffn_hidden_size=self.moe_ffn_hidden(hf),
            moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
            moe_layer_freq=1 if all(pattern) else pattern,
        )
        if self.shared_expert_block:
            fields.update(
                moe_shared_expert_intermediate_size=self.shared_ffn_hidden(hf),
                moe_shared_expert_gate=self.shared_expert_gate is not None,
            )
        return fields

    def shared_ffn_hidden(self, hf: dict) -> int:
        return hf_config.get_int(hf, "shared_expert_intermediate_size")

    # -- weights ----------------------------------------------------------------------------------
    def mapping(self, hf: dict) -> MappingRegistry:
        rules: list[Rule] = embedding_rules(hf) + gqa_attention_rules(hf, self.has_qk_norm(hf))
        rules += pre_mlp_norm_rules() + dense_mlp_rules()
        if self.expert_naming is not None:
            rules += routed_expert_rules(self.expert_naming)
        if self.shared_expert_block:
            rules += shared_expert_rules(self.shared_expert_block, self.shared_expert_gate)
        return MappingRegistry(rules)

    # -- planner ----------------------------------------------------------------------------------
    def dims(self, hf: dict) -> ModelDims:
        g = hf_config.get_int
        experts = hf_config.num_experts(hf) if self.expert_naming is not None else 0
        if self.expert_naming is not None and not experts:
            hf_config.get(hf, "num_experts")  # raises, naming every spelling
        moe_layers = tuple(i for i, m in enumerate(moe_layer_pattern(hf)) if m) if experts else ()
        bias = self.has_qkv_bias(hf)
        return ModelDims(
            model_type=self.name,
            vocab_size=g(hf, "vocab_size"),
            hidden=g(hf, "hidden_size"),
            num_layers=g(hf, "num_hidden_layers"),
            num_heads=hf_config.num_heads(hf),
            num_kv_heads=hf_config.num_kv_heads(hf),
            head_dim=hf_config.head_dim(hf),
            ffn_hidden=g(hf, "intermediate_size"),
            moe_ffn_hidden=self.moe_ffn_hidden(hf) if experts else 0,
            num_experts=experts,
            topk=g(hf, "num_experts_per_tok") if experts else 0,
            moe_layers=moe_layers,
            qk_norm=self.has_qk_norm(hf),
            qkv_bias=bias,
            o_bias=False,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings") or 1 << 30),
            rope_type=hf_config.rope_type(hf),
            shared_expert_ffn=self.shared_ffn_hidden(hf) if experts and self.shared_expert_block else 0,
            shared_expert_gate=bool(experts and self.shared_expert_gate),
        )


# -- the sigmoid router of DeepSeek-V3 / GLM-4.5 (shared by those families) --------------------------


def sigmoid_router_check(hf: dict, family: str) -> None:
    """Refuse (one line) what Megatron-Core's sigmoid top-k computes differently from transformers'
    DeepSeek-style router: ``norm_topk_prob=false`` with top-k > 1 (Megatron always renormalizes),
    group-limited routing with ``num_experts_per_tok // topk_group != 2`` (Megatron scores a group by
    its top-(topk/topk_group) experts, transformers by its top-2)."""
    topk = hf_config.get_int(hf, "num_experts_per_tok")
    if topk > 1 and not hf.get("norm_topk_prob", True):
        raise ValueError(
            f"config.json norm_topk_prob=false with num_experts_per_tok > 1 is not supported for "
            f"{family} (Megatron renormalizes sigmoid top-k)"
        )
    groups, gtopk = router_groups(hf)
    if groups and gtopk is not None and topk // gtopk != 2:  # router_groups: both None or both set
        raise ValueError(
            f"config.json num_experts_per_tok={topk} // topk_group={gtopk} != 2 is not supported "
            f"for {family} (group scores: top-2 per group)"
        )


def router_groups(hf: dict) -> tuple[int | None, int | None]:
    """(n_group, topk_group) when group-limited routing keeps fewer than all groups, else (None, None)."""
    n, k = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    return (n, k) if 1 < n and k < n else (None, None)


def sigmoid_router_fields(hf: dict) -> dict:
    """TransformerConfig fields: sigmoid scores, the correction bias as the router's ``expert_bias``
    buffer, frozen (``moe_router_bias_update_rate=0``: not trained by the policy loss, exported and
    synced as loaded), group-limited top-k, ``routed_scaling_factor``."""
    groups, gtopk = router_groups(hf)
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=groups,
        moe_router_group_topk=gtopk,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
    )
