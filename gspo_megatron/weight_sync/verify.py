"""Check after a sync that the engines hold the trainer's weights.

Two ways, depending on what the engine can report:
- ``weight_checksums(names)`` (engines that can read whole HF-named tensors, e.g. the CPU
  transformers engine): float64 sums compared with the trainer's (:func:`verify_engine_checksums`).
- SGLang's ``get_weights_by_name`` returns only the leading ``truncate_size`` rows of TP rank 0's
  shard. For a TP-sharded weight that block is ``full[:r, :c]`` (column-parallel shards split dim 0,
  so TP rank 0's first rows are the full tensor's; row-parallel shards split dim 1, so its columns
  are the first ``c``), so it is compared elementwise with the same block of the trainer's tensor
  (:func:`verify_engine_prefixes`). Fused SGLang params (qkv, gate_up) are unfused by its models.

Called on the rank that owns the engine (global rank 0), with the trainer's full HF tensors for the
sampled names (from the export stream). A mismatch raises :class:`WeightMismatchError` naming the tensor.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch


class WeightMismatchError(RuntimeError):
    """The engine's copy of ``name`` differs from the trainer's."""

    def __init__(self, name: str, detail: str):
        super().__init__(f"weight sync mismatch for {name!r}: {detail}")
        self.name = name


def tensor_checksum(t: torch.Tensor) -> float:
    """float64 sum of all elements (the checksum both sides compute)."""
    return float(t.detach().to(torch.float64).sum().item())


def trainer_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    return {name: tensor_checksum(t) for name, t in named_tensors}


def sample_names(names: Sequence[str], k: int, seed: int = 0) -> list[str]:
    """Up to ``k`` names: the first and last always (embeddings / head), the rest drawn with ``seed``."""
    names = list(names)
    if k >= len(names):
        return names
    if k <= 0:
        return []
    picked = {names[0], names[-1]} if k >= 2 else {names[0]}
    rest = [n for n in names if n not in picked]
    picked.update(random.Random(seed).sample(rest, k - len(picked)))
    return [n for n in names if n in picked]


def compare_checksums(expected: Mapping[str, float], actual: Mapping[str, float], *, rtol: float = 1e-6,
                      atol: float = 1e-6, abs_sums: Mapping[str, float] | None = None) -> None:
    """Raise on the first name whose checksums differ by more than ``atol + rtol * scale``
    (``scale`` = sum of |x| when given, which bounds float rounding of a sum; else |expected|)."""
    for name, e in expected.items():
        if name not in actual:
            raise WeightMismatchError(name, "engine reported no checksum")
        a = float(actual[name])
        scale = abs_sums[name] if abs_sums is not None and name in abs_sums else abs(e)
        if not abs(a - e) <= atol + rtol * scale:
            raise WeightMismatchError(name, f"trainer checksum {e!r} != engine checksum {a!r}")


def verify_engine_checksums(engine: Any, trainer_tensors: Mapping[str, torch.Tensor], *, rtol: float = 1e-6,
                            atol: float = 1e-6) -> None:
    """Ask ``engine.weight_checksums`` for the trainer tensors' names and compare."""
    expected = {n: tensor_checksum(t) for n, t in trainer_tensors.items()}
    abs_sums = {n: float(t.detach().double().abs().sum()) for n, t in trainer_tensors.items()}
    compare_checksums(expected, engine.weight_checksums(list(expected)), rtol=rtol, atol=atol, abs_sums=abs_sums)


def compare_prefix(name: str, full: torch.Tensor, block: torch.Tensor, *, rtol: float = 0.0,
                   atol: float = 0.0) -> None:
    """``block`` (engine, float) must equal the leading block of ``full`` with the same shape."""
    block = block.to(torch.float32)
    if block.dim() != full.dim():
        raise WeightMismatchError(name, f"engine block has {block.dim()} dims, trainer tensor {tuple(full.shape)}")
    if any(b > f for b, f in zip(block.shape, full.shape)):
        raise WeightMismatchError(name, f"engine block {tuple(block.shape)} larger than trainer {tuple(full.shape)}")
    ref = full[tuple(slice(0, b) for b in block.shape)].detach().cpu().to(torch.float32)
    diff = (ref - block).abs()
    bad = diff > atol + rtol * ref.abs()
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise WeightMismatchError(name, f"element {idx}: trainer {ref[idx].item()!r} != engine "
                                        f"{block[idx].item()!r} (max |diff| {diff.max().item():.3g})")


def verify_engine_prefixes(fetch: Callable[[str], torch.Tensor], trainer_tensors: Mapping[str, torch.Tensor],
                           *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """``fetch(name)`` -> the engine's leading block (e.g. ``SGLangRolloutEngine.weight_prefix``).
    Exact by default: bf16 weights sent and read back as float32 are bit-identical."""
    for name, full in trainer_tensors.items():
        try:
            block = fetch(name)
        except Exception as e:
            raise WeightMismatchError(name, f"engine could not return it: {e}") from e
        compare_prefix(name, full, torch.as_tensor(block), rtol=rtol, atol=atol)
