"""Loading a Megatron dist checkpoint with one copy per byte: each item read straight into its
tensor (:func:`direct_reads`), and the gated MLP's fc1 not re-assembled (:func:`merge_swiglu_in_place`).

Megatron-Core saves a gated (SwiGLU) ``linear_fc1.weight`` of shape ``[2*ffn, hidden]`` through a
``ShardedTensorFactory`` (``apply_swiglu_sharded_factory``): two ShardedTensors, ``torch.chunk``
views of the parameter along dim 0 (gate rows, then up rows). On load, dist_checkpointing reads
each half *into those views* (the torch_dist strategy loads into the tensors it is given), then the
factory's ``merge_fn`` concatenates them into a new tensor (``torch.cat``), which
``model.load_state_dict`` copies back into the very parameter the halves were read into. For an MoE
that is most of the bytes read twice more (measured: 0.8 s of a 5.3 s Megatron -> HF conversion of a
0.9 GB Qwen3-MoE was that ``torch.cat``).

:func:`merge_swiglu_in_place` replaces that merge, for Megatron's own swiglu factories only, by one
that returns the parameter itself when the loaded halves are exactly its two consecutive halves in
memory (then ``cat(halves) == parameter`` bitwise, by construction), and falls back to Megatron's
merge otherwise (a strategy that loaded elsewhere, a flattened range, another merge function).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import os
import pickle
import struct
import sys
import zipfile

import torch
from torch.futures import Future

from gspo_megatron.checkpoint.safetensors_shards import memory_bytes, pread_into

_SWIGLU_MERGE = ("megatron.core.transformer.mlp", "sh_ten_merge_fn")


def _halves_are_data(parts, data: torch.Tensor | None) -> bool:
    """``parts`` (the loaded sub-state-dict) are, in order, consecutive dim-0 slices of ``data``'s
    memory covering all of it: concatenating them along dim 0 gives ``data``."""
    if data is None or not isinstance(parts, (list, tuple)) or not parts or not data.is_contiguous():
        return False
    if not all(isinstance(p, torch.Tensor) for p in parts):
        return False
    ptr, size = data.data_ptr(), data.element_size()
    for p in parts:
        if (
            p.dtype != data.dtype
            or p.device != data.device
            or not p.is_contiguous()
            or p.dim() != data.dim()
            or p.shape[1:] != data.shape[1:]
            or p.data_ptr() != ptr
        ):
            return False
        ptr += p.numel() * size
    return ptr == data.data_ptr() + data.numel() * size


def _in_place(factory):
    merge, data = factory.merge_fn, factory.data

    def merge_fn(parts):
        if _halves_are_data(parts, data):
            return data
        return merge(parts)

    return merge_fn


def merge_swiglu_in_place(sharded_state_dict) -> int:
    """Walk a (nested) sharded state dict before ``dist_checkpointing.load`` and give Megatron's
    swiglu factories the in-place merge (see the module docstring). Returns how many were changed."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    changed = 0
    for v in nested_values(sharded_state_dict):
        fn = getattr(v, "merge_fn", None)
        if (
            isinstance(v, ShardedTensorFactory)
            and v.flattened_range is None
            and (getattr(fn, "__module__", None), getattr(fn, "__name__", None)) == _SWIGLU_MERGE
        ):
            v.merge_fn = _in_place(v)
            changed += 1
    return changed


# ---------------------------------------------------------------- reading items straight into tensors
@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """ "FloatStorage" -> torch.float32, ... (the typed storage classes a tensor's pickle names)."""
    from torch.storage import _storage_type_to_dtype_map

    return _storage_type_to_dtype_map()


class _TensorMetaUnpickler(pickle.Unpickler):
    """Unpickles the ``data.pkl`` of a ``torch.save``d plain tensor into ``(dtype, storage key,
    storage numel, storage_offset, size, stride)`` without touching its data; refuses every global
    but the few a plain tensor's pickle names (``pickle.UnpicklingError`` otherwise)."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _tensor_meta
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _storage_dtypes():
            return _storage_dtypes()[name]  # a typed storage class (FloatStorage, ...) stands for its dtype
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a plain tensor's pickle")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"persistent id {kind!r}")
        return dtype, str(key), int(numel)


def _tensor_meta(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if backward_hooks or metadata:
        raise pickle.UnpicklingError("a tensor with hooks or metadata")
    return (*storage, int(storage_offset), tuple(size), tuple(stride))


class _Window(io.RawIOBase):
    """The bytes ``[offset, offset + length)`` of an open file descriptor as a seekable read-only
    file (``pread``: no shared file position). Its first and last ``edge`` bytes are read once up
    front: a zip reader's many small reads of a torch.save archive (the directory at the end, the
    pickle and local headers at the start) are then served from memory."""

    def __init__(self, fd: int, offset: int, length: int, edge: int = 4096):
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0
        self.head = os.pread(fd, min(edge, length), offset)
        tail_start = max(0, length - edge)
        self.tail_start = tail_start
        self.tail = (
            self.head[tail_start:]
            if tail_start < len(self.head)
            else os.pread(fd, length - tail_start, offset + tail_start)
        )

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence] + pos)
        return self.pos

    def readinto(self, buf) -> int:
        start = self.pos
        end = min(self.length, start + len(buf))
        if end <= start:
            return 0
        if end <= len(self.head):
            data = self.head[start:end]
        elif start >= self.tail_start:
            data = self.tail[start - self.tail_start : end - self.tail_start]
        else:
            data = os.pread(self.fd, end - start, self.offset + start)
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _record_start(f, info: zipfile.ZipInfo) -> int:
    """Offset in ``f`` of the bytes of the stored (uncompressed) record ``info``: after its local
    header, whose name and extra field lengths may differ from the central directory's."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"a compressed record ({info.filename})")
    f.seek(info.header_offset)
    header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError("no local header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _read_record(f, info: zipfile.ZipInfo) -> bytes:
    """A small stored record's bytes, read as they are: torch.save may leave the CRC-32 out
    (``set_crc32_options(False)``, as ``checkpoint.writer`` does), which zipfile's reader would refuse."""
    f.seek(_record_start(f, info))
    data = f.read(info.file_size)
    if len(data) != info.file_size:
        raise ValueError(f"a truncated record ({info.filename})")
    return data


def saved_tensor_layout(f) -> tuple[torch.Tensor, int]:
    """Where the data of the plain tensor ``torch.save`` wrote into the seekable file ``f`` lies:
    ``(meta, offset)``, a meta-device tensor with the saved dtype, shape, strides and storage offset,
    and the byte offset of its storage in ``f``. Reads the zip directory, the pickle and one local
    header (records with or without their CRC-32). Raises ValueError for anything else (compressed
    or big-endian records, other objects)."""
    with zipfile.ZipFile(f) as zf:
        infos = {i.filename: i for i in zf.infolist()}
    pkl = [n for n in infos if n.endswith("/data.pkl") or n == "data.pkl"]
    if len(pkl) != 1:
        raise ValueError("not a torch.save archive")
    prefix = pkl[0][: -len("data.pkl")]
    if prefix + "byteorder" in infos and _read_record(f, infos[prefix + "byteorder"]) != b"little":
        raise ValueError("big-endian records")
    meta = _TensorMetaUnpickler(io.BytesIO(_read_record(f, infos[pkl[0]]))).load()
    if not (isinstance(meta, tuple) and len(meta) == 6):
        raise ValueError("not a plain tensor")
    dtype, key, numel, storage_offset, size, stride = meta
    info = infos.get(f"{prefix}data/{key}")
    if info is None or info.file_size != numel * dtype.itemsize:
        raise ValueError("a missing or mis-sized data record")
    start = _record_start(f, info)
    tensor = torch.empty(numel, dtype=dtype, device="meta").as_strided(size, stride, storage_offset)
    return tensor, start


def direct_reader_class():
    """Megatron's ``CachedMetadataFileSystemReader`` whose tensor reads go straight into the tensor
    being loaded: one ``preadv`` per item by the kernel, where torch DCP's ``FileSystemReader``
    buffers the item, ``torch.load``s it (a second copy) and ``copy_``s it into the target (a third).

    Each saved tensor item is a ``torch.save`` archive; :func:`saved_tensor_layout` reads its zip
    directory and pickle (not its data) and tells the tensor's dtype, shape, strides and where its
    storage lies; the wanted region is then at ``item offset + record offset + the narrowed view's
    storage offset``. An item takes this path when nothing transforms it on disk,
    the requested region of the stored tensor is contiguous, and the target is a contiguous CPU
    tensor of the same dtype and shape; any other item (bytes, a GPU target, a strided slice, an
    unexpected archive) goes through the base class unchanged. ``direct_items`` counts the tensor
    items read directly, ``base_tensor_items`` those handed to the base class (the tests check them)."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType

    class DirectFileSystemReader(CachedMetadataFileSystemReader):
        direct_items = 0
        base_tensor_items = 0

        def _record(self, fd: int, item_md, cache: dict):
            """(meta tensor, absolute offset of its storage) of one stored item, or None."""
            key = (item_md.relative_path, item_md.offset)
            if key not in cache:
                try:
                    meta, rec = saved_tensor_layout(_Window(fd, item_md.offset, item_md.length))
                    cache[key] = (meta, item_md.offset + rec)
                except Exception:  # noqa: BLE001 (not an archive this path understands: the base class reads it)
                    cache[key] = None
            return cache[key]

        def read_data(self, plan, planner) -> Future:
            if sys.byteorder != "little":
                return super().read_data(plan, planner)
            rest: list = []
            records: dict[tuple[str, int], tuple[torch.Tensor, int] | None] = {}  # _record's cache
            fds: dict[str, int] = {}
            try:
                for req in plan.items:
                    item_md = self.storage_data[req.storage_index]
                    if req.type == LoadItemType.BYTE_IO or item_md.transform_descriptors:
                        rest.append(req)
                        continue
                    path = os.path.join(self.path, item_md.relative_path)
                    if path not in fds:
                        fds[path] = os.open(path, os.O_RDONLY)
                    fd = fds[path]
                    found = self._record(fd, item_md, records)
                    if found is None:
                        rest.append(req)
                        continue
                    meta, base = found
                    src = narrow_tensor_by_index(meta, req.storage_offsets, req.lengths)
                    dst = planner.resolve_tensor(req).detach()
                    if not (
                        src.is_contiguous()
                        and dst.is_contiguous()
                        and dst.device.type == "cpu"
                        and dst.dtype == src.dtype
                        and dst.shape == src.shape
                    ):
                        rest.append(req)
                        continue
                    if dst.numel():
                        pread_into(fd, memory_bytes(dst), base + src.storage_offset() * src.element_size(), path)
                    planner.commit_tensor(req, dst)
                    type(self).direct_items += 1
            finally:
                for fd in fds.values():
                    os.close(fd)
            type(self).base_tensor_items += sum(req.type != LoadItemType.BYTE_IO for req in rest)
            if rest:
                return super().read_data(dataclasses.replace(plan, items=rest), planner)
            fut: Future = Future()
            fut.set_result(None)
            return fut

    return DirectFileSystemReader


@contextlib.contextmanager
def direct_reads():
    """Within the block, Megatron's torch_dist load strategy reads through
    :func:`direct_reader_class` (it builds its reader with the module function
    ``_get_filesystem_reader``, which offers no other hook; with a multi-storage client enabled, or
    a Megatron without that function, nothing changes). Yields the reader class."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    cls = direct_reader_class()
    original = getattr(mcore_torch, "_get_filesystem_reader", None)
    msc = getattr(mcore_torch, "MultiStorageClientFeature", None)
    if original is None or (msc is not None and msc.is_enabled()):
        yield cls
        return

    def get_reader(checkpoint_dir, cache_metadata: bool = False):
        return cls(checkpoint_dir) if cache_metadata else original(checkpoint_dir, cache_metadata)

    mcore_torch._get_filesystem_reader = get_reader
    try:
        yield cls
    finally:
        mcore_torch._get_filesystem_reader = original
