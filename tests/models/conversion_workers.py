"""Rank functions for the model-equivalence tests (module level: spawned ranks import them)."""

from __future__ import annotations


def convert_and_score(rank: int, world: int, jobs: list[dict], rows: list[list[int]]) -> dict:
    """For each job {"kind", "hf_dir", "ckpt", "write": layout, "read": [layouts]}: convert the HF
    directory into a Megatron checkpoint in the "write" layout, then for every "read" layout load
    it (resharding), score ``rows`` through the scorer path and export the HF weights.
    Returns, on rank 0, {(kind, layout_name): {"logprobs": [...], "weights": {name: tensor}}}."""
    from gspo_megatron import convert
    from gspo_megatron.models.weights import export_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.score import score_rows

    results = {}
    for job in jobs:
        w = job["write"]
        init_distributed(ParallelLayout(**w))
        convert.hf_to_megatron(job["hf_dir"], job["ckpt"], **w)
        for layout in job["read"]:
            init_distributed(ParallelLayout(**layout))
            model, _ = convert.load_model(job["ckpt"], **layout)
            lps = score_rows(model, rows, micro_batch_size=3)
            weights = {}
            for bucket in export_hf_weights(model, bucket_bytes=1 << 18):
                if bucket is not None:
                    weights.update({n: t.clone() for n, t in bucket})
            if rank == 0:
                results[(job["kind"], layout_name(layout))] = {"logprobs": lps, "weights": weights}
    destroy_distributed()
    return results if rank == 0 else {}


def layout_name(layout: dict) -> str:
    return "+".join(f"{k}{v}" for k, v in sorted(layout.items())) or "tp1"
