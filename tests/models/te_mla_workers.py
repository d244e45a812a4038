"""Rank functions for tests/models/test_deepseek_v3_te.py and test_dsa_te.py (and the GPU test): the
DeepSeek-V3 / V3.2 / GLM-5 models built on megatron-core 0.16.1's Transformer Engine layer spec with the TE stand-in (``te_standin.py``; installed first, before
megatron is imported, in each spawned rank). Module level imports stay light for that reason."""

from __future__ import annotations


def te_layout(rank: int, world: int, layout: dict, hf_dir: str, bucket_bytes: int) -> dict:
    """Build the TE model of ``hf_dir`` in ``layout`` ({"tp", "ep"}), report this rank's parameters and
    buffers (global name -> shape, ``tensor_model_parallel``), the state dict's ``_extra_state`` keys
    and whether the model reads as TE-built; then load the HF weights into it and keep a copy of
    every tensor the mapping fills (global name -> tensor), and export them back (rank 0: HF name ->
    tensor, and the HF names of each bucket)."""
    import te_standin

    te_standin.install()
    te_standin.patch_build()
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.mapping import uses_transformer_engine
    from gspo_megatron.models.param_names import global_names, named_tensors
    from gspo_megatron.models.weights import export_hf_weights, load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    tp, ep = layout.get("tp", 1), layout.get("ep", 1)
    init_distributed(ParallelLayout(**layout, sequence_parallel=tp > 1), seed=0)
    hf = load_hf_config(hf_dir)
    model = build_model(
        hf, tp, 1, ep, opts=ModelOptions(transformer_impl="transformer_engine", perform_initialization=False)
    )
    names = global_names(model)
    params = {n for n, _ in model.named_parameters()}
    tensors = {
        names[n]: dict(
            shape=tuple(t.shape), param=n in params, tensor_model_parallel=getattr(t, "tensor_model_parallel", None)
        )
        for n, t in named_tensors(model)
    }
    extra = sorted(k for k in model.state_dict() if k.endswith("_extra_state"))
    # per attention module (its name; pp 1: local = global): its core attention's class, whether that
    # holds an indexer and whether it normalizes qr with this module's fused linear_q_up_proj norm
    # (DSA on TE: TEMLASelfAttention -> bind_fused_q_norm)
    cores = {
        n: dict(
            cls=type(m).__name__,
            indexer=getattr(m, "indexer", None) is not None,
            q_norm_bound=getattr(getattr(m, "q_norm", None), "args", (None,))[0]
            is getattr(parent, "linear_q_up_proj", 0),
        )
        for n, parent in model.named_modules()
        if (m := getattr(parent, "core_attention", None)) is not None and n.endswith("self_attention")
    }
    loaded = load_hf_weights(model, hf_dir)
    values = {names[n]: t.detach().clone() for n, t in named_tensors(model)}
    exported, buckets = {}, []
    for bucket in export_hf_weights(model, bucket_bytes=bucket_bytes):
        if bucket is not None:
            exported.update({n: t.clone() for n, t in bucket})
            buckets.append([n for n, _ in bucket])
    out = dict(
        tensors=tensors,
        extra_state=extra,
        cores=cores,
        te=uses_transformer_engine(model),
        loaded=loaded,
        values=values,
        exported=exported,
        buckets=buckets,
    )
    destroy_distributed()
    return out


def te_logprobs(rank: int, world: int, hf_dir: str, rows: list[list[int]], tp: int, max_tokens: int = 0) -> list | None:
    """On GPUs with the real Transformer Engine (tests/gpu/test_deepseek_v3_te_gpu.py): the TE model of
    ``hf_dir`` in tp ``tp``, loaded from HF, scores ``rows`` (fp32; padded micro-batches of 3 rows, or
    packed (THD) ones of up to ``max_tokens`` tokens); per-row log-probs on rank 0."""
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.mapping import uses_transformer_engine
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.score import score_rows

    init_distributed(ParallelLayout(tp=tp, sequence_parallel=tp > 1), seed=0)
    model = build_model(load_hf_config(hf_dir), tp, opts=ModelOptions(transformer_impl="transformer_engine"))
    assert uses_transformer_engine(model)
    load_hf_weights(model, hf_dir)
    lps = score_rows(model, rows, micro_batch_size=3, max_tokens_per_micro_batch=max_tokens)
    destroy_distributed()
    return lps


def standin_logprobs(
    rank: int, world: int, hf_dir: str, rows: list[list[int]], tp: int, max_tokens: int = 0
) -> list | None:
    """On CPU: :func:`te_logprobs` with the TE stand-in (``te_standin.py``: plain-torch forwards of TE's
    modules); a model whose core attention is TE's own cannot run (DSA's is ours)."""
    import te_standin

    te_standin.install()
    te_standin.patch_build()
    return te_logprobs(rank, world, hf_dir, rows, tp, max_tokens)
