"""Safetensors shard files laid out in advance, so that several ranks fill one file in parallel.

The HF export (``convert.export_to_hf_dir``) knows every tensor it will write (name, shape, dtype,
in stream order) before any data moves: the export plan is global. From that list this module

1. cuts the tensors into shards of at most ``max_shard_size`` bytes, in stream order, exactly as
   ``save_pretrained``-style sequential writers do (a shard is closed when the next tensor would
   overflow it; a single larger tensor gets a shard of its own);
2. computes each shard's safetensors header and every tensor's byte range, byte for byte what
   ``safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})`` writes for the same
   tensors: 8-byte little-endian header length, the JSON header (``__metadata__`` first, then the
   tensors sorted by dtype, descending in safetensors' ``Dtype`` enum order, then by name, with
   contiguous ``data_offsets``), padded with spaces to a multiple of 8, then the raw data
   (``tests/tools/test_safetensors_shards.py`` checks the bytes against ``save_file``);
3. lets rank 0 create the files (header written, size set) and any rank ``pwrite`` the bytes of the
   tensors it owns at their offsets, with no copy beyond making a tensor contiguous on the CPU.

Going around safetensors: its writers (``save_file`` / ``serialize_file``) take the whole dict of a
file at once in one process; they cannot let N ranks write disjoint parts of one file, nor write a
tensor as soon as it is assembled without holding the shard in memory. Reading stays with
safetensors (``safe_open``).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from gspo_megatron.runtime.files import fsync_dir, fsync_file, write_atomic

# safetensors' Dtype enum order (safetensors 0.4 - 0.8, Rust ``Dtype``): files sort tensors by it
# (largest first). Only the dtypes listed here can be written.
_DTYPE_ORDER = [
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "F64",
    "I64",
    "U64",
]
_CODES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
}
METADATA = {"format": "pt"}


def dtype_code(dtype: torch.dtype) -> str:
    if dtype not in _CODES:
        raise ValueError(f"cannot write {dtype} into safetensors shards ({', '.join(map(str, _CODES))})")
    return _CODES[dtype]


def nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * dtype.itemsize


def memory_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory, for ``os.pread`` / ``os.pwrite``.

    Not ``t.numpy()``: torch marks a storage that numpy has seen as not resizable, and the training
    state's storages are resized to 0 and back when ``rollout.offload_train`` moves them."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("memory_bytes needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def pread_into(fd: int, view: memoryview, pos: int, what: str) -> None:
    """Fill ``view`` with the file's bytes from ``pos`` on (``preadv`` until done: the kernel copies
    straight into ``view``); ValueError naming ``what`` when the file ends first."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], pos + done)
        if got <= 0:
            raise ValueError(f"{what}: the file ended early (offset {pos + done})")
        done += got


@dataclass
class Shard:
    """One safetensors file: its tensors, header and each tensor's absolute byte offset."""

    tensors: list[tuple[str, tuple[int, ...], torch.dtype]] = field(default_factory=list)
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)
    size: int = 0

    def layout(self) -> None:
        order = sorted(self.tensors, key=lambda t: (-_DTYPE_ORDER.index(dtype_code(t[2])), t[0].encode()))
        entries: dict[str, dict[str, Any]] = {"__metadata__": METADATA}
        start = 0
        relative: dict[str, int] = {}
        for name, shape, dtype in order:
            end = start + nbytes(shape, dtype)
            entries[name] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [start, end]}
            relative[name] = start
            start = end
        text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
        text += b" " * (-len(text) % 8)
        self.header = struct.pack("<Q", len(text)) + text
        self.offsets = {n: len(self.header) + o for n, o in relative.items()}
        self.size = len(self.header) + start


def plan_shards(tensors: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_size: int) -> list[Shard]:
    """Cut ``tensors`` (stream order) into shards of at most ``max_shard_size`` data bytes."""
    shards, current, size = [], Shard(), 0
    for name, shape, dtype in tensors:
        n = nbytes(shape, dtype)
        if current.tensors and size + n > max_shard_size:
            shards.append(current)
            current, size = Shard(), 0
        current.tensors.append((name, tuple(shape), dtype))
        size += n
    if current.tensors or not shards:
        shards.append(current)
    for s in shards:
        s.layout()
    return shards


def temp_name(i: int) -> str:
    return f".part-{i:05d}.safetensors.tmp"


def final_names(shards: list[Shard]) -> list[str]:
    n = len(shards)
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def create_files(out_dir: str, shards: list[Shard]) -> None:
    """Rank 0: each shard's temp file with its header, extended to its full size."""
    for i, s in enumerate(shards):
        with open(os.path.join(out_dir, temp_name(i)), "wb") as f:
            f.write(s.header)
            f.truncate(s.size)


class ShardFiles:
    """Where each tensor goes (any rank, after ``create_files``): ``write(name, tensor)``, or
    ``write(name, row, index)`` for row ``index`` of a stacked tensor [rows, ...]."""

    def __init__(self, out_dir: str, shards: list[Shard]):
        self.where = {name: (i, off) for i, s in enumerate(shards) for name, off in s.offsets.items()}
        self.shapes = {name: (shape, dtype) for s in shards for name, shape, dtype in s.tensors}
        self.out_dir = out_dir
        self._fds: dict[int, int] = {}

    def write(self, name: str, tensor: torch.Tensor, row: int | None = None) -> int:
        """pwrite ``tensor``'s bytes at its place; returns the byte count."""
        shape, dtype = self.shapes[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != (tuple(shape) if row is None else tuple(shape[1:])):
            raise ValueError(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the plan says "
                f"{tuple(shape)} {dtype}" + ("" if row is None else f" (row {row})")
            )
        i, offset = self.where[name]
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        size = t.numel() * t.element_size()
        if size == 0:
            return 0
        if row is not None:
            offset += row * size
        if i not in self._fds:
            self._fds[i] = os.open(os.path.join(self.out_dir, temp_name(i)), os.O_WRONLY)
        view = memory_bytes(t)
        done = 0
        while done < size:
            done += os.pwrite(self._fds[i], view[done:], offset + done)
        return size

    def close(self) -> None:
        """fsync and close the files this rank wrote into (each rank its own parts, in parallel)."""
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()


def finish_files(out_dir: str, shards: list[Shard]) -> list[str]:
    """Rank 0, after every rank closed (and fsynced) its files: each file fsynced once more (its
    header, and the data of any rank that wrote none), the usual file mode, the final names (the
    directory fsynced after the renames, so a crash never leaves a final name over missing data)
    and, when sharded, ``model.safetensors.index.json``. Returns the file names."""
    umask = os.umask(0)
    os.umask(umask)
    names = final_names(shards)
    weight_map, total = {}, 0
    for i, (s, final) in enumerate(zip(shards, names)):
        tmp = os.path.join(out_dir, temp_name(i))
        fsync_file(tmp)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, os.path.join(out_dir, final))
        weight_map.update({name: final for name, _, _ in s.tensors})
        total += sum(nbytes(shape, dtype) for _, shape, dtype in s.tensors)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_atomic(os.path.join(out_dir, "model.safetensors.index.json"), json.dumps(index, indent=2))
    fsync_dir(out_dir)
    return names
