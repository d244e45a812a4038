"""Rank function of tests/models/test_equivalence.py (module level: spawned ranks import it)."""

from __future__ import annotations

from conversion_workers import layout_name, score_and_export


def convert_and_score_by_layout(rank: int, world: int, jobs: list[dict], rows: list[list[int]]) -> dict:
    """What ``conversion_workers.convert_and_score`` computes for the same jobs (each {"kind", "hf_dir",
    "ckpt", "write": layout, "read": [layouts]}: convert the HF directory into a Megatron checkpoint in
    the "write" layout, load it in every "read" layout, score ``rows`` and export the HF weights), in
    layout-major order: the parallel state is initialized once per distinct layout and every job's
    checkpoint that uses it is written or read there. Re-initializing it (Megatron's groups, a few
    dozen gloo groups per layout on 4 ranks) cost more than converting or reading a tiny model.
    Every model is still built fresh for its (kind, layout) and loaded from the checkpoint.
    Returns, on rank 0, {(kind, layout_name): {"logprobs": [...], "weights": {name: tensor}}}."""
    from gspo_megatron import convert
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    def by_layout(pairs):
        """[(layout, [items])] in first-seen order of the layouts."""
        groups: dict[str, tuple[dict, list]] = {}
        for layout, item in pairs:
            groups.setdefault(layout_name(layout), (layout, []))[1].append(item)
        return list(groups.values())

    for layout, group in by_layout((job["write"], job) for job in jobs):
        init_distributed(ParallelLayout(**layout))
        for job in group:
            convert.hf_to_megatron(job["hf_dir"], job["ckpt"], **layout)
    results = {}
    for layout, group in by_layout((layout, job) for job in jobs for layout in job["read"]):
        init_distributed(ParallelLayout(**layout))
        for job in group:
            scored = score_and_export(job["ckpt"], layout, rows)
            if rank == 0:
                results[(job["kind"], layout_name(layout))] = scored
    destroy_distributed()
    return results if rank == 0 else {}
