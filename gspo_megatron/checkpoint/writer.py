"""Saving a Megatron dist checkpoint (torch_dist format) from the tensors' own memory, in this
process: :func:`direct_writes`.

Megatron-Core's writer (``strategies/filesystem_async.FileSystemWriterAsync``, which the torch_dist
save strategy builds for every save) does four things a synchronous save does not need:

- it ``clone``s every CPU tensor that is a view of a larger storage (``torch.save`` would write the
  whole storage): the gated fc1's two halves, i.e. most of an MoE's bytes (0.05 s per 246 MB);
- it forks ``thread_count`` writer processes per save (0.04 s, and a fork of a multi-threaded
  trainer: CPython 3.11's after-fork hazards, see ``runtime/children.py``), which report through a
  ``multiprocessing`` Manager server it spawns on first use (a fresh interpreter importing torch);
- ``torch.save`` computes a CRC-32 of every record (0.1-0.2 s per 246 MB with torch's zip writer,
  as long as the write itself), which no reader checks: ``torch.load`` ignores it (torch documents
  ``torch.serialization.set_crc32_options(False)`` as loadable) and a ``.distcp`` file, a
  concatenation of archives, is no zip file an unzip tool could test.

:class:`DirectFileSystemWriter` (a subclass of Megatron's writer: same buckets, file names, write
results and ``.metadata``, so the checkpoint is the one Megatron writes, bit for bit in every
tensor byte) gives ``torch.save`` a tensor over exactly the view's bytes (a slice of the storage:
no copy), writes each bucket's file from a thread of this process (the writes and ``fsync`` release
the GIL, so the files still go out in parallel), with the records' CRC left out, and hands the
results over in an in-process queue. GPU tensors are staged to host memory as Megatron does
(its ``preload_tensors``); only then is anything written.

Only for synchronous saves (``dist_checkpointing.save``, which runs the writer in the calling
process): the in-process queue would not cross to Megatron's asynchronous writer process.
"""

from __future__ import annotations

import contextlib
import os
import queue
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch


def exact_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (detached) over a storage holding exactly its bytes, sharing its memory: what
    ``torch.save`` then writes is the view, not the storage it is a view of. A CPU tensor that is
    not dense and in storage order (a strided slice) is cloned, as Megatron's writer does; a GPU
    tensor is returned as it is (it is staged to host memory later)."""
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    storage = t.untyped_storage()
    if t.device.type != "cpu" or storage.nbytes() == nbytes:
        return t
    if not t.is_contiguous():
        return t.clone()
    start = t.storage_offset() * t.element_size()
    view = storage[start : start + nbytes]  # shares the memory and keeps the whole storage alive
    return torch.empty(0, dtype=t.dtype).set_(view, 0, t.shape, t.stride())


@contextlib.contextmanager
def records_without_crc():
    """``torch.save`` in this thread skips the records' CRC-32 within the block (torch's setting is
    per thread: a user override of its config module lives in a ContextVar)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def direct_writer_class():
    """Megatron's ``FileSystemWriterAsync`` writing in this process from the tensors' memory (see
    the module docstring). ``files_written`` counts the files its instances wrote (tests)."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
        _split_by_separation_hint,
        _split_by_size_and_type,
    )
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _write_item
    from torch.distributed.checkpoint.planner import WriteItemType

    class DirectFileSystemWriter(FileSystemWriterAsync):
        files_written = 0

        def prepare_write_data(self, plan, planner) -> None:
            """The buckets (one file each) Megatron's writer makes, with each tensor given over its
            exact bytes instead of cloned; a queue of this process for the results."""
            bins = self.thread_count // 2 if self.separation_hint is not None else self.thread_count
            prefix = plan.storage_data.prefix
            # (file path, file name, (byte items, tensor items)) per bucket
            self.write_buckets: list[tuple[str, str, tuple[list, list]]] = []
            for group, buckets in _split_by_separation_hint(
                _split_by_size_and_type(bins, plan.items), self.separation_hint
            ).items():
                for bucket in buckets:
                    data = [(item, planner.resolve_data(item)) for item in bucket]
                    bytes_data = [(item, d) for item, d in data if item.type == WriteItemType.BYTE_IO]
                    tensor_data = [(item, exact_storage(d)) for item, d in data if item.type != WriteItemType.BYTE_IO]
                    if bytes_data or tensor_data:
                        name = f"{group}{prefix}{len(self.write_buckets)}{DEFAULT_SUFFIX}"
                        self.write_buckets.append(
                            (os.path.join(self.checkpoint_dir, name), name, (bytes_data, tensor_data))
                        )
            self.results_queue: queue.Queue | None = queue.Queue() if self.write_buckets else None

        def get_save_function_and_args(self):
            if not self.write_buckets:
                return None, None, []
            transforms = [self.transforms] if hasattr(self, "transforms") else []
            on_gpu = any(t.device.type != "cpu" for _, _, (_, tensors) in self.write_buckets for _, t in tensors)
            preload = partial(self.preload_tensors, self.write_buckets, True) if on_gpu else None
            return (
                partial(self.write_buckets_here, transforms),
                preload,
                [torch.distributed.get_rank(), self.write_buckets, self.results_queue],
            )

        @classmethod
        def write_buckets_here(cls, transforms: list, rank: int, write_buckets: list, results_queue) -> None:
            """Write every bucket's file (a thread each), fsync it, and put ``{bucket index: write
            results}`` -- or the first exception -- on ``results_queue``."""
            with ThreadPoolExecutor(max(1, len(write_buckets))) as pool:
                futures = [pool.submit(cls.write_bucket, transforms, b) for b in write_buckets]
            results: dict[int, list] | Exception
            try:
                results = {i: f.result() for i, f in enumerate(futures)}
            except Exception as e:  # noqa: BLE001 (handed to Megatron's finalize, which raises it)
                results = e
            results_queue.put(results)

        @classmethod
        def write_bucket(cls, transforms: list, bucket) -> list:
            path, storage_key, (bytes_data, tensor_data) = bucket
            results, kwargs = [], _serialization_kwargs(_write_item)
            with records_without_crc(), open(path, "wb") as stream:
                for item, data in [*bytes_data, *tensor_data]:  # tensors made exact in prepare_write_data
                    # (torch's private _write_item: its arguments differ between torch versions, which
                    # ``transforms`` and ``kwargs`` follow; the checker knows the installed one only)
                    results.append(_write_item(*transforms, stream, data, item, storage_key, **kwargs))  # type: ignore[call-arg]
                stream.flush()
                os.fsync(stream.fileno())
            cls.files_written += 1
            return results

    return DirectFileSystemWriter


def _serialization_kwargs(write_item) -> dict:
    """What torch's ``_write_item`` needs beyond the item: newer torch asks which serialization format
    (``torch.save`` archives: the torch_dist format), as Megatron's writer passes it."""
    import inspect

    if "serialization_format" not in inspect.signature(write_item).parameters:
        return {}
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    return {"serialization_format": SerializationFormat.TORCH_SAVE}


@contextlib.contextmanager
def direct_writes():
    """Within the block, Megatron's torch_dist save strategy writes through
    :func:`direct_writer_class` (it builds its writer from the module name ``FileSystemWriterAsync``
    in ``strategies/torch.py``, which offers no other hook). Yields the writer class; None (nothing
    changed: Megatron's own writer, its processes and Manager) with a multi-storage client enabled or
    a Megatron without that name."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    original = getattr(mcore_torch, "FileSystemWriterAsync", None)
    msc = getattr(mcore_torch, "MultiStorageClientFeature", None)
    if original is None or (msc is not None and msc.is_enabled()):
        yield None
        return
    cls = mcore_torch.FileSystemWriterAsync = direct_writer_class()
    try:
        yield cls
    finally:
        mcore_torch.FileSystemWriterAsync = original
