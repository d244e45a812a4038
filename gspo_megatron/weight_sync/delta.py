"""Delta weight sync (``rollout.sync_delta``): send per tensor only the elements that changed.

At RL learning rates most bf16 weights do not change in a step (the update is below bf16's
resolution), so after the first sync the engines need only the changed elements. The trainer keeps
the copy it last sent, in the engine dtype, on host memory (:class:`DeltaEncoder`); the engine keeps
the same copy (``weight_sync.delta_loader``) and rebuilds the full HF tensors from it, which it hands
to sglang's ``model.load_weights`` as a full sync would.

Changed is decided on bit patterns: ``new.view(int) != old.view(int)`` elementwise (int16 for 2-byte
dtypes, int32 / int64 / uint8 likewise), so -0.0 vs +0.0 and different NaN payloads are changes,
and the rebuilt tensor equals the sent one bit for bit.

Per tensor of ``n`` elements of ``e`` bytes with ``k`` changed, the smallest of:

- ``index``:   flat indices (int32 when n < 2**31, else int64) + values: ``k * (4|8) + k * e`` bytes;
- ``bitmask``: a packed bit per element (bit ``i % 8`` of byte ``i // 8``, little-endian) + values:
  ``ceil(n / 8) + k * e`` bytes;
- ``full``:    the tensor itself, ``n * e`` bytes, chosen whenever neither delta is smaller.

Wire format (one list of (name, tensor) pairs per bucket, what ``update_weights_from_tensor`` carries):
``(EPOCH, int64 [1])`` first, then per HF name either ``(name, full tensor)`` or
``(IDX + name, int32|int64 [k])`` / ``(MASK + name, uint8 [ceil(n/8)])`` followed by
``(VAL + name, dtype [k])``. An unchanged tensor is an index record with ``k = 0``: every name of
the bucket is listed, because a colocated engine's weights are released and zero-filled between
syncs (sglang's memory saver keeps no backup), so the engine reloads every tensor from its copy.

Entries may instead travel in a file (engines on other hosts: ``weight_sync.delta_http``):
``(FILE, uint8 [path bytes])`` names a safetensors file, on a file system the engine sees at the same
path, holding wire entries (full tensors under their HF names, ``IDX`` / ``MASK`` / ``VAL`` records
under theirs) of the same epoch; they are read in place of the ``FILE`` entry.

The epoch is a random 63-bit id drawn when the encoder's copy is (re)started: after
:meth:`DeltaEncoder.reset` (a new process, a failed sync, an engine restart) every tensor goes full
under a new epoch, and the engine refuses a delta whose base it holds under another epoch (an
engine restarted without the trainer knowing fails the sync instead of loading wrong weights).
"""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

PREFIX = "__gspo_delta__/"
EPOCH = PREFIX + "epoch"
IDX = PREFIX + "idx/"
MASK = PREFIX + "mask/"
VAL = PREFIX + "val/"
FILE = PREFIX + "file"

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (any dtype, contiguous) viewed as the signed / unsigned integer of its element size, flat [n]."""
    return t.contiguous().view(-1).view(_INT_VIEW[t.element_size()])


def changed_mask(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """bool [n]: where the bit patterns of ``new`` and ``old`` (same shape and dtype) differ."""
    if new.shape != old.shape or new.dtype != old.dtype:
        raise ValueError(f"changed_mask: new {tuple(new.shape)} {new.dtype} vs old {tuple(old.shape)} {old.dtype}")
    return bit_view(new) != bit_view(old)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [n] -> uint8 [ceil(n / 8)]; element i is bit ``i % 8`` of byte ``i // 8``."""
    n = mask.numel()
    padded = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8, device=mask.device)
    padded[:n] = mask.view(-1).to(torch.uint8)
    weights = (1 << torch.arange(8, device=mask.device, dtype=torch.int32)).to(torch.uint8)
    return (padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [ceil(n / 8)] -> bool [n] (inverse of :func:`pack_bits`)."""
    if packed.numel() != math.ceil(n / 8):
        raise ValueError(f"unpack_bits: {packed.numel()} bytes for {n} elements (need {math.ceil(n / 8)})")
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    bits = (packed.to(torch.int32).view(-1, 1) >> shifts) & 1
    return bits.view(-1)[:n].bool()


def index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 2**31 else torch.int64


def encoded_sizes(n: int, k: int, elem: int) -> dict[str, int]:
    """Bytes of each encoding of a tensor of ``n`` elements of ``elem`` bytes with ``k`` changed."""
    idx = 4 if n < 2**31 else 8
    return {"index": k * (idx + elem), "bitmask": math.ceil(n / 8) + k * elem, "full": n * elem}


def choose_encoding(n: int, k: int, elem: int) -> str:
    """``"index"`` / ``"bitmask"`` whichever is smaller (index on a tie), ``"full"`` unless a delta is smaller."""
    s = encoded_sizes(n, k, elem)
    best = "index" if s["index"] <= s["bitmask"] else "bitmask"
    return best if s[best] < s["full"] else "full"


def encode_tensor(
    name: str, new: torch.Tensor, old: torch.Tensor | None
) -> tuple[str, list[tuple[str, torch.Tensor]], int]:
    """(encoding, wire entries, changed count k) for one tensor against the copy ``old`` last sent
    (None: nothing sent yet -> full). ``new`` must already be in the engine dtype."""
    if old is None:
        return "full", [(name, new)], new.numel()
    flat = new.contiguous().view(-1)
    mask = changed_mask(new, old)
    k = int(mask.sum())
    kind = choose_encoding(flat.numel(), k, new.element_size())
    if kind == "full":
        return kind, [(name, new)], k
    if kind == "index":
        idx = mask.nonzero().view(-1).to(index_dtype(flat.numel()))
        return kind, [(IDX + name, idx), (VAL + name, flat[idx.long()].clone())], k
    return kind, [(MASK + name, pack_bits(mask)), (VAL + name, flat[mask].clone())], k


def apply_delta(base: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, kind: str) -> None:
    """In place: ``base.view(-1)[positions] = values``; ``positions`` are flat indices (``kind``
    "index") or a packed bitmask ("bitmask", changed elements in ascending order)."""
    flat = base.view(-1)
    if kind == "index":
        flat[positions.to(device=flat.device, dtype=torch.long)] = values.to(flat.device)
    elif kind == "bitmask":
        flat[unpack_bits(positions.to(flat.device), flat.numel())] = values.to(flat.device)
    else:
        raise ValueError(f"apply_delta: unknown kind {kind!r}")


@dataclass
class DeltaStats:
    """One sync's totals: ``full_bytes`` (what a full sync sends), ``wire_bytes`` (what was sent),
    ``elements`` / ``changed`` (element counts), tensors per encoding."""

    full_bytes: int = 0
    wire_bytes: int = 0
    elements: int = 0
    changed: int = 0
    encodings: dict[str, int] = field(default_factory=lambda: {"full": 0, "index": 0, "bitmask": 0})

    def metrics(self) -> dict[str, float]:
        return {
            "sync/delta_wire_bytes": float(self.wire_bytes),
            "sync/delta_full_bytes": float(self.full_bytes),
            "sync/delta_fraction": self.changed / max(1, self.elements),
            "sync/delta_tensors_full": float(self.encodings["full"]),
        }


def entries_nbytes(entries: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in entries)


class DeltaEncoder:
    """The trainer's side: the host copy (engine dtype) of every tensor last sent, and the encoder.

    Memory: one host copy of every tensor this encoder sends, ``sum(numel * element_size)`` of the
    engine dtype (the model's bytes for a colocated engine's sending rank).
    ``encode_bucket`` updates the copy as it encodes: a sync that fails must be followed by
    :meth:`reset` (the engines may hold anything), which makes the next sync full under a new epoch."""

    def __init__(self) -> None:
        self.copy: dict[str, torch.Tensor] = {}
        self.epoch = 0
        self.stats = DeltaStats()
        self.reset()

    def reset(self) -> None:
        """Forget the copy: the next sync sends every tensor in full, under a new epoch."""
        self.copy.clear()
        self.epoch = secrets.randbits(63)

    def begin(self) -> None:
        self.stats = DeltaStats()

    @property
    def host_bytes(self) -> int:
        return entries_nbytes(self.copy.items())

    def encode_bucket(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """bucket of (HF name, full tensor in the engine dtype) -> wire entries (module docstring)."""
        out: list[tuple[str, torch.Tensor]] = [(EPOCH, torch.tensor([self.epoch], dtype=torch.int64))]
        for name, t in bucket:
            t = t.detach()
            new = t if t.device.type == "cpu" else t.to("cpu")
            old = self.copy.get(name)
            if old is not None and (old.shape != new.shape or old.dtype != new.dtype):
                old = None
            kind, entries, k = encode_tensor(name, new, old)
            if kind == "full":
                entries = [(name, t)]  # the tensor itself (on its device: a CUDA IPC handle on GPU)
            self._record(name, new, old, kind, entries, k)
            out.extend(entries)
        return out

    def _record(self, name, new, old, kind, entries, k) -> None:
        s = self.stats
        s.full_bytes += new.numel() * new.element_size()
        s.wire_bytes += entries_nbytes(entries)
        s.elements += new.numel()
        s.changed += k
        s.encodings[kind] += 1
        if old is None:
            self.copy[name] = new.contiguous().clone()
        elif k:
            old.copy_(new)


def file_entry(path: str) -> tuple[str, torch.Tensor]:
    """The wire entry naming a safetensors file of full tensors (module docstring)."""
    return FILE, torch.tensor(list(path.encode("utf-8")), dtype=torch.uint8)


def _file_entries(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The wire entries stored in the file a ``FILE`` entry names, in decoding order (each ``IDX`` /
    ``MASK`` record followed by its ``VAL``)."""
    from safetensors.torch import load_file

    path = bytes(t.to("cpu", torch.uint8).tolist()).decode("utf-8")
    if not os.path.isfile(path):
        raise ValueError(
            f"delta payload names {path!r}, which this engine's host does not have "
            "(rollout.sync_delta_dir must be on a file system the engine hosts see at the same path)"
        )
    stored = load_file(path)
    out = []
    for name, tensor in stored.items():
        if name.startswith(VAL):
            continue
        out.append((name, tensor))
        for kind in (IDX, MASK):
            if name.startswith(kind):
                val = VAL + name[len(kind) :]
                if val not in stored:
                    raise ValueError(f"delta file {path!r}: {name!r} without {val!r}")
                out.append((val, stored[val]))
    return out


def decode_entries(
    entries: Sequence[tuple[str, torch.Tensor]],
    copy: dict[str, tuple[int, torch.Tensor]],
    keep: Callable[[str], bool] | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The engine's side of :meth:`DeltaEncoder.encode_bucket`: wire entries -> (HF name, full tensor).

    ``copy`` (name -> (epoch, host tensor)) is updated in place: a full entry replaces the copy, a
    delta is applied to it. Returns the copies themselves (the caller copies them before handing
    them to a loader that may write into its input). ValueError names the tensor when a delta has
    no base of this epoch (the engine restarted, or its copy is from another trainer).
    ``keep(name)`` False: the tensor is skipped, neither copied nor returned (an engine TP rank that
    does not load it: ``delta_loader``)."""
    if not entries or entries[0][0] != EPOCH:
        raise ValueError(f"delta payload must start with {EPOCH!r}")
    epoch = int(entries[0][1].view(-1)[0])
    entries = [e for n, t in entries for e in (_file_entries(t) if n == FILE else [(n, t)])]
    out, i = [], 1
    while i < len(entries):
        name, t = entries[i]
        if not name.startswith(PREFIX):
            if keep is None or keep(name):
                copy[name] = (epoch, t.detach().to("cpu", copy=True).contiguous())
                out.append((name, copy[name][1]))
            i += 1
            continue
        kind = "index" if name.startswith(IDX) else "bitmask" if name.startswith(MASK) else None
        if kind is None or i + 1 >= len(entries):
            raise ValueError(f"delta payload: unexpected entry {name!r}")
        hf = name[len(IDX if kind == "index" else MASK) :]
        vname, values = entries[i + 1]
        if vname != VAL + hf:
            raise ValueError(f"delta payload: {name!r} must be followed by {VAL + hf!r}, got {vname!r}")
        i += 2
        if keep is not None and not keep(hf):
            continue
        held = copy.get(hf)
        if held is None or held[0] != epoch:
            why = "no copy of it" if held is None else f"its copy is of epoch {held[0]}, the delta of {epoch}"
            raise ValueError(
                f"delta for {hf!r} but this engine holds {why}: the trainer must send a full sync (engine restarted?)"
            )
        apply_delta(held[1], t, values, kind)
        out.append((hf, held[1]))
    return out
