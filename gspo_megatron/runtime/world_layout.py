"""The parallel layout's rules that need only its sizes and the world size (no model, no torch): used by
``runtime.distributed.ParallelLayout.check`` at process-group start and by
``parallel_layout.layout_errors``, which adds the model's rules."""

from __future__ import annotations


def world_layout_errors(
    tp: int, pp: int, ep: int, etp: int, cp: int, *, world_size: int | None, prefix: str = "parallel."
) -> list[str]:
    """The layout's rules that need only the sizes and the world (Megatron-Core's): every size >= 1,
    tp * pp * cp and ep * etp * pp divide ``world_size`` (None: sizes only). One line per problem,
    fields spelled with ``prefix``; ``parallel_layout.layout_errors`` adds the model's rules."""
    sizes = {"tp": tp, "pp": pp, "ep": ep, "etp": etp, "cp": cp}
    bad = [f"{prefix}{k} must be >= 1, got {v}" for k, v in sizes.items() if v < 1]
    if bad or world_size is None:
        return bad
    if world_size < 1:
        return [f"world size must be >= 1, got {world_size}"]
    e: list[str] = []
    mp = tp * pp * cp
    if world_size % mp:
        e.append(
            f"{prefix}tp * {prefix}pp * {prefix}cp = {tp} * {pp} * {cp} = {mp} must divide the world size {world_size}"
        )
    emp = ep * etp * pp
    if world_size % emp:
        e.append(
            f"{prefix}ep * {prefix}etp * {prefix}pp = {ep} * {etp} * {pp} = {emp} must divide the world size {world_size}"
        )
    return e
