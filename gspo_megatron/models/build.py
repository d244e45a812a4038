"""Build this rank's Megatron-Core GPT model (its pipeline stage, its experts) from an HF config.

Every rank calls ``build_model`` after ``runtime.init_distributed``. Transformer Engine's layer spec is
used on GPU when TE imports (FP8 options come from ``fp8_fields``); Megatron's local spec otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gspo_megatron.dtypes import torch_dtype
from gspo_megatron.models import hf_config
from gspo_megatron.models.registry import get_family
from gspo_megatron.parallel_layout import layout_errors
from gspo_megatron.runtime import distributed as rdist

if TYPE_CHECKING:
    from gspo_megatron.models.lora import LoraOptions


@dataclass
class ModelOptions:
    """Training-side knobs that are not in the HF config."""

    dtype: str = "float32"
    transformer_impl: str = "auto"  # auto | local | transformer_engine
    moe_token_dispatcher: str = "alltoall"  # alltoall | allgather
    moe_aux_loss_coeff: float = 0.0
    recompute: bool = False
    sequence_parallel: bool | None = None  # None: on when MoE and tp > 1
    fp8_fields: dict | None = None  # TransformerConfig fp8 kwargs (runtime/fp8.py)
    # False skips the random init (conversion tools), but Megatron then also skips setting the
    # tensor-parallel attributes of the parameters: never train such a model with TP > 1.
    perform_initialization: bool = True
    # model.lora: adapters on the local spec's linears, every other parameter frozen (models/lora.py)
    lora: LoraOptions | None = None
    # model.mtp: the checkpoint's MTP layer as megatron's MTP block (models/mtp.py), the engines' draft
    mtp: bool = False


def use_transformer_engine(impl: str) -> bool:
    if impl == "local":
        return False
    try:
        import transformer_engine  # noqa: F401

        have_te = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - TE does not import without CUDA
        have_te = False
    if impl == "transformer_engine" and not have_te:
        raise RuntimeError(
            "model.transformer_impl=transformer_engine but Transformer Engine "
            "is not usable here (needs CUDA and the transformer-engine package)"
        )
    return have_te


def check_layout(hf: dict, tp: int, pp: int, ep: int, etp: int | None = None) -> None:
    """Raise ValueError naming the field a layout does not fit (``parallel_layout.layout_errors``)."""
    get_family(hf).check(hf)
    errors = layout_errors(tp, pp, ep, etp, hf=hf)
    if errors:
        raise ValueError("; ".join(errors))


def transformer_config(hf: dict, tp: int, pp: int, ep: int, etp: int | None, cp: int, opts: ModelOptions):
    """The Megatron config (the family's class, e.g. TransformerConfig) for an HF config and a layout."""
    family = get_family(hf)
    fields = family.config_fields(hf)
    dtype = torch_dtype(opts.dtype)
    is_moe = "num_moe_experts" in fields
    te = use_transformer_engine(opts.transformer_impl)
    family.check_transformer_impl(te)
    sp = opts.sequence_parallel
    if sp is None:
        # MoE with TP requires it; for QK-norm models it also makes Megatron all-reduce the q/k norm
        # gradients over TP (each rank's heads contribute a partial sum).
        sp = tp > 1
    fields.update(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp if etp is not None else tp,
        sequence_parallel=sp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=opts.perform_initialization,
        init_method_std=float(hf.get("initializer_range", 0.02)),
        # PP micro-batches of different lengths; Megatron allows it with the alltoall dispatcher only
        variable_seq_lengths=opts.moe_token_dispatcher == "alltoall",
        moe_token_dispatcher_type=opts.moe_token_dispatcher,
        attention_softmax_in_fp32=True,
    )
    if is_moe:
        fields.update(
            moe_grouped_gemm=te,
            moe_router_load_balancing_type="aux_loss" if opts.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=opts.moe_aux_loss_coeff,
            moe_router_dtype="fp32",
        )
    if opts.recompute:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if opts.fp8_fields:
        fields.update(opts.fp8_fields)
    if opts.mtp:  # megatron's own MTP loss is never computed (models/mtp.py): its scale is unused
        from gspo_megatron.models.carried import mtp_layers

        fields.update(mtp_num_layers=mtp_layers(hf), mtp_loss_scaling_factor=0.0)
    config_class = family.megatron_config_class()
    if getattr(config_class, "cuda_graph_scope", None) == "full":
        # Megatron 0.16's default, which it warns is deprecated on every config and converts to []
        # (capture the whole layer; read only when CUDA graphs are on): pass [] directly
        fields.setdefault("cuda_graph_scope", [])
    return config_class(**fields)


def build_model(
    hf: dict,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    cp: int = 1,
    opts: ModelOptions | None = None,
):
    """This rank's GPTModel (its pipeline stage; its experts). Call after init_distributed."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    opts = opts or ModelOptions()
    check_layout(hf, tp, pp, ep, etp)
    if opts.mtp:
        from gspo_megatron.models.mtp import mtp_errors, mtp_layout_errors

        errors = mtp_errors(hf) + mtp_layout_errors(pp, cp, hf)
        if errors:
            raise ValueError("model.mtp: " + "; ".join(errors))
    config = transformer_config(hf, tp, pp, ep, etp, cp, opts)
    te = use_transformer_engine(opts.transformer_impl)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm")
    family = get_family(hf)
    family.adapt_layer_spec(spec, te)
    if not te:  # packed (THD) micro-batches through the local attention (models/packed_attention.py)
        from gspo_megatron.models.packed_attention import use_packed_local_attention

        use_packed_local_attention(spec)
    model_class, extra = GPTModel, {}
    if opts.mtp:  # the MTP block of the decoder layer's spec, on the last stage (models/mtp.py)
        from gspo_megatron.models.mtp_model import MTPGPTModel, mtp_block_spec

        model_class = MTPGPTModel
        extra["mtp_block_spec"] = mtp_block_spec(config, spec, te, family)
    model = model_class(
        config,
        spec,
        vocab_size=hf_config.get_int(hf, "vocab_size"),
        max_sequence_length=int(hf.get("max_position_embeddings") or 4096),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        **family.rotary_kwargs(hf),
        **extra,
    )
    model.hf_config = hf  # the mapping and export read it back
    model.lora = None
    if opts.lora is not None and opts.lora.rank > 0:
        from gspo_megatron.models.lora import apply_lora, check_targets_used

        apply_lora(model, opts.lora)
        everyone = [model.lora_unused_targets]
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            everyone = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(everyone, model.lora_unused_targets)
        check_targets_used(everyone)
    mark_replicated_experts(model, tp, ep, etp)
    # Megatron's own get_model (megatron/training/training.py) moves every chunk to the current GPU
    # after building it: modules the spec builds without a device (torch.nn.RMSNorm, through Megatron's
    # WrappedTorchNorm on the local spec) start on the CPU. Megatron's DDP buffer happens to move the
    # trained model's parameters; a model used without DDP (the KL reference, conversion) needs this.
    device = rdist.device()
    if device.type != "cpu":  # on CPU every parameter is already there (or on meta, for shape-only builds)
        model.to(device)
    return model


def mark_replicated_experts(model, tp: int, ep: int, etp: int | None) -> int:
    """Megatron-Core 0.16.1 fix (its bug, on GPU and CPU alike): route the routed experts' gradients
    through the expert-data-parallel reduction whenever their layout differs from the dense one.

    Megatron marks an expert parameter as expert-parallel (``param.allreduce = False``: its own grad
    buffer reduced over the expert-data-parallel group, its own optimizer and grad-norm group) only
    when ``expert_model_parallel_size > 1`` (tensor_parallel/layers.py, moe/experts.py,
    extensions/transformer_engine.py all test ``ep > 1``). With EP1 and ETP < TP (e.g. TP2 x ETP1),
    every TP rank holds the full experts and runs them on its own sequence-parallel tokens, so each
    rank's expert gradient covers 1/(TP/ETP) of the tokens; marked dense, it is reduced over the dense
    DP group, which does not contain the other TP ranks, and the sum over them never happens (each
    rank then steps on a partial gradient, and the grad norm counts the partial gradients of every
    rank). Marking them expert-parallel makes DDP sum them over the expert-DP group (size
    world / (ETP x EP x PP), which spans those TP ranks) with the same 1/DP scaling, and the expert
    optimizer counts them once per expert-model-parallel rank in the norm.

    Applied to every parameter of the routed-expert modules (not the shared experts, which are dense
    TP) when ``ep == 1`` and ``etp != tp``; a no-op otherwise (EP > 1: Megatron already marks them;
    ETP = TP with EP1: both groups are the same). Returns how many parameters it marked.

    The expert classes are looked up by name: the legacy ``GroupedMLP`` (never built here: grouped
    GEMM is on only with Transformer Engine, i.e. ``TEGroupedMLP``) is gone from megatron-core 0.19;
    the environment pins 0.16.1 (pyproject.toml, tests/test_gpu_pins.py), this only keeps a newer one
    from failing at every model build."""
    from megatron.core.transformer.moe import experts

    etp = tp if etp is None else etp
    if ep > 1 or etp == tp:
        return 0
    kinds = tuple(getattr(experts, n) for n in ("GroupedMLP", "SequentialMLP", "TEGroupedMLP") if hasattr(experts, n))
    marked = 0
    for module in model.modules():
        if isinstance(module, kinds):
            for param in module.parameters():
                param.allreduce = False
                marked += 1
    return marked
