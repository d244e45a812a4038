"""Rank functions for tests/models/test_deepseek_v3_te.py and test_dsa_te.py (and the GPU test): the
DeepSeek-V3 / V3.2 / GLM-5 models built on megatron-core 0.16.1's Transformer Engine layer spec with the TE stand-in (``te_standin.py``; installed first, before
megatron is imported, in each spawned rank). Module level imports stay light for that reason."""

from __future__ import annotations

import re

from distributed_harness import fresh_process

# The layouts the CPU tests build the TE model in: one rank, tensor parallel 2, expert parallel 2.
LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "ep2": {"ep": 2}}
# The MLA down projections: TELinear "duplicated" on TE, whole on every TP rank.
DOWN = re.compile(r"\.self_attention\.linear_(q|kv)_down_proj\.weight$")


@fresh_process  # the TE stand-in is installed before megatron is imported
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


@fresh_process  # the TE stand-in is installed before megatron is imported
def standin_logprobs(
    rank: int, world: int, hf_dir: str, rows: list[list[int]], tp: int, max_tokens: int = 0
) -> list | None:
    """On CPU: :func:`te_logprobs` with the TE stand-in (``te_standin.py``: plain-torch forwards of TE's
    modules); a model whose core attention is TE's own cannot run (DSA's is ours)."""
    import te_standin

    te_standin.install()
    te_standin.patch_build()
    return te_logprobs(rank, world, hf_dir, rows, tp, max_tokens)


def te_layout_runs(hf_dir: str, bucket_bytes: int = 1 << 14) -> dict[str, list[dict]]:
    """{layout name: per-rank results of :func:`te_layout`} for ``hf_dir`` in each of ``LAYOUTS`` (one
    spawn per layout; the test process's side, as are the checks below)."""
    from distributed_harness import run_ranks

    return {
        name: run_ranks(te_layout, layout.get("tp", 1) * layout.get("ep", 1), layout, hf_dir, bucket_bytes)
        for name, layout in LAYOUTS.items()
    }


def check_te_rules(ranks: list[dict], te_rules, full: dict, tp: int) -> None:
    """Every parameter and mapped buffer of the TE model on every rank (``ranks``: :func:`te_layout`'s
    results in tensor parallel ``tp``) is covered by exactly one of ``te_rules`` (the mapping's TE rules),
    with the shape that rule gives the rank and the value ``load_hf_weights`` put there (from ``full``,
    the HF tensors); the duplicated down projections are not TP-parallel (counted once in the grad norm)."""
    import torch

    for rank, res in enumerate(ranks):
        assert res["te"]  # the model reads as TE-built: the weights code picks the TE rules
        for gname, info in res["tensors"].items():
            matches = [r for r in te_rules.rules if r.match(gname) is not None]
            if not info["param"] and not matches:
                continue  # a buffer the mapping leaves alone (rotary caches, token counts)
            assert len(matches) == 1, (gname, [r.megatron for r in matches])
            (rule,) = matches
            size = {"tp": tp, "etp": tp}.get(rule.parallel, 1)
            pos = {"tp": rank % tp, "etp": rank % tp}.get(rule.parallel, 0)  # tp is the innermost group
            local = rule.to_local([full[h] for h in rule.hf_names(rule.match(gname))], pos, size)
            assert tuple(local.shape) == info["shape"], (gname, rule.megatron)
            assert torch.equal(res["values"][gname], local), gname
            if DOWN.search(gname):
                assert info["tensor_model_parallel"] is False, gname  # te_attention.TEMLASelfAttention


def check_round_trip(ranks: list[dict], te_rules, full: dict, hf: dict) -> dict:
    """HF -> Megatron (TE) -> HF is bitwise: rank 0 exports every tensor of ``full`` (the HF tensors of
    config ``hf``) but the carried ones, bitwise, and each comes from exactly one Megatron tensor of the
    model over all ``ranks`` (by ``te_rules``). Returns the expected export (HF name -> tensor)."""
    import torch

    from gspo_megatron.models.carried import carried_names

    exported = ranks[0]["exported"]
    expected = {n: t for n, t in full.items() if n not in set(carried_names(hf, list(full)))}
    assert sorted(exported) == sorted(expected)
    for name, t in expected.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    sources: dict[str, set[str]] = {}
    for res in ranks:
        for gname in res["tensors"]:
            found = te_rules.find(gname)
            if found is not None and found[0].export:
                for h in found[1]:
                    sources.setdefault(h, set()).add(gname)
    assert sorted(sources) == sorted(expected)
    assert all(len(s) == 1 for s in sources.values()), {h: s for h, s in sources.items() if len(s) > 1}
    return expected
