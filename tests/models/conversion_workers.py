"""Rank functions for the model-equivalence tests (module level: spawned ranks import them)."""

from __future__ import annotations


def convert_and_score(rank: int, world: int, jobs: list[dict], rows: list[list[int]]) -> dict:
    """For each job {"kind", "hf_dir", "ckpt", "write": layout, "read": [layouts]}: convert the HF
    directory into a Megatron checkpoint in the "write" layout, then for every "read" layout load
    it (resharding), score ``rows`` through the scorer path and export the HF weights.
    Returns, on rank 0, {(kind, layout_name): {"logprobs": [...], "weights": {name: tensor}}}."""
    from gspo_megatron import convert
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    results = {}
    for job in jobs:
        w = job["write"]
        init_distributed(ParallelLayout(**w))
        convert.hf_to_megatron(job["hf_dir"], job["ckpt"], **w)
        for layout in job["read"]:
            init_distributed(ParallelLayout(**layout))
            scored = score_and_export(job["ckpt"], layout, rows)
            if rank == 0:
                results[(job["kind"], layout_name(layout))] = scored
    destroy_distributed()
    return results if rank == 0 else {}


def score_and_export(ckpt: str, layout: dict, rows: list[list[int]]) -> dict:
    """In the initialized ``layout``: the checkpoint ``ckpt`` loaded, ``rows`` scored and the HF weights
    exported: {"logprobs": [...], "weights": {name: tensor}} (this rank's view; rank 0's is the whole)."""
    from gspo_megatron import convert
    from gspo_megatron.models.weights import export_hf_weights
    from gspo_megatron.score import score_rows

    model, _ = convert.load_model(ckpt, **layout)
    lps = score_rows(model, rows, micro_batch_size=3)
    weights = {}
    for bucket in export_hf_weights(model, bucket_bytes=1 << 18):
        if bucket is not None:
            weights.update({n: t.clone() for n, t in bucket})
    return {"logprobs": lps, "weights": weights}


def layout_name(layout: dict) -> str:
    return "+".join(f"{k}{v}" for k, v in sorted(layout.items())) or "tp1"


def export_aliasing(rank: int, world: int, hf_dir: str) -> dict:
    """One rank: which exported tensors share memory with a parameter, through the weight stream
    (``export_hf_weights``: never) and through ``gather_full`` (the HF export: a gated fc1's halves
    are views of the parameter, no copy); and whether the streamed tensors equal the HF file's."""
    from safetensors.torch import load_file

    from gspo_megatron import convert
    from gspo_megatron.models.mapping import GatedFC1
    from gspo_megatron.models.weights import build_export_plan, export_hf_weights, gather_full
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    init_distributed(ParallelLayout())
    model, _ = convert.load_model(hf_dir)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    streamed, aliased = {}, []
    for bucket in export_hf_weights(model, bucket_bytes=1 << 18):
        for name, t in bucket or []:
            streamed[name] = t.clone()
            if t.untyped_storage().data_ptr() in storages:
                aliased.append(name)
    items, mine = build_export_plan(model)
    gated = [it for it in items if isinstance(mine[it.global_name][0], GatedFC1)]
    views = [
        all(
            t.untyped_storage().data_ptr() == mine[it.global_name][1].untyped_storage().data_ptr()
            for t in gather_full(it, mine)
        )
        for it in gated
    ]
    import glob

    hf = {}
    for f in glob.glob(f"{hf_dir}/*.safetensors"):
        hf.update(load_file(f))
    return dict(
        aliased=aliased,
        gated=len(gated),
        views=views,
        equal=sorted(hf) == sorted(streamed) and all(torch_equal(hf[k], streamed[k]) for k in hf),
    )


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)
