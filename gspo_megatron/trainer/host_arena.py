"""Host memory for the offloaded training state (``trainer.offload.TrainStateOffloader``), reserved at
start-up in a background thread so that its allocation is off the first step's critical path.

Why: pinning host memory costs about 1 s per GiB (the driver locks every page): on one H100 host the
first ``offload()`` of a 27.5 GiB state spent 24.8 s allocating its pinned buffers, against 0.61 s
for every later offload (docs/gpu.md). :meth:`HostArena.reserve` starts that allocation in a
daemon thread when the trainer is built, so it runs while the checkpoint loads and the engines start;
the first offload only waits for what is left of it (``offload/host_wait_s``).

Layout: ``chunks``, each a 1-D uint8 tensor (pinned when ``pin``) of ``chunk_bytes`` bytes, the last
one the power of two that covers the rest. Powers of two because PyTorch's caching host allocator
rounds every pinned request up to the next power of two (``CachingHostAllocator``: ``PowerOf2Ceil``),
so a 27.5 GiB tensor would pin 32 GiB; 1 GiB chunks pin what is asked plus under one chunk.
:meth:`HostArena.pieces` lays a list of byte sizes end to end over the chunks (a storage may span
two or more chunks): for each size, ``(start, host view)`` pieces that together cover its bytes. A
request larger than the capacity grows the arena then and there (``grown_bytes``; synchronous, on
the critical path: the prediction it was reserved with was short).

The same code runs on CPU with ``pin=False`` (plain host tensors, written once when reserved so that
their pages are committed then, as pinning commits them), which is what CI tests.
"""

from __future__ import annotations

import threading
import time

import torch

CHUNK_BYTES = 1 << 30


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class HostArena:
    """Chunks of host memory (module docstring). ``reserve(nbytes)`` in the background, ``wait()``,
    ``pieces(sizes)``; ``alloc_s`` (seconds spent allocating, background and on demand), ``wait_s``
    (seconds a caller waited for the background reservation), ``grown_bytes`` (allocated on demand
    because the reservation was short), ``capacity``."""

    def __init__(self, pin: bool, chunk_bytes: int = CHUNK_BYTES):
        if chunk_bytes <= 0 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"HostArena: chunk_bytes must be a power of two, got {chunk_bytes}")
        self.pin, self.chunk_bytes = pin, chunk_bytes
        self.chunks: list[torch.Tensor] = []
        self.alloc_s = 0.0
        self.wait_s = 0.0
        self.grown_bytes = 0
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    @property
    def capacity(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def _grow(self, nbytes: int) -> int:
        """Allocate chunks until the capacity covers ``nbytes``; returns the bytes allocated."""
        t0, added = time.perf_counter(), 0
        while self.capacity < nbytes:
            size = min(self.chunk_bytes, _pow2_at_least(nbytes - self.capacity))
            chunk = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            if not self.pin:  # pinning commits the pages; plain host memory commits them when first written
                chunk.zero_()
            self.chunks.append(chunk)
            added += size
        self.alloc_s += time.perf_counter() - t0
        return added

    def _reserve(self, nbytes: int) -> None:
        try:
            self._grow(nbytes)
        except (RuntimeError, MemoryError) as e:  # re-raised by wait() in the caller's thread (allocation failures)
            self._error = e

    def reserve(self, nbytes: int) -> None:
        """Start allocating ``nbytes`` in a daemon thread (torch releases the GIL while it allocates);
        returns at once. One reservation at a time. (The thread's current CUDA device does not
        matter: PyTorch's host allocator pins through a device that already has a primary context,
        and pinned memory is usable from every device under unified addressing.)"""
        if self._thread is not None:
            raise RuntimeError("HostArena.reserve: a reservation is already running or done")
        self._thread = threading.Thread(target=self._reserve, args=(int(nbytes),), name="host-arena", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the background reservation (if any) is done; raise its error if it failed
        (e.g. pinned memory exhausted: the message is the allocator's)."""
        if self._thread is None:
            return
        t0 = time.perf_counter()
        self._thread.join()
        self.wait_s += time.perf_counter() - t0
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def pieces(self, sizes: list[int]) -> list[list[tuple[int, torch.Tensor]]]:
        """Lay ``sizes`` (bytes) end to end over the chunks, growing the arena if they do not fit:
        for each size, its ``(start byte in the storage, host uint8 view)`` pieces, in order."""
        self.wait()
        total = sum(sizes)
        if total > self.capacity:
            self.grown_bytes += self._grow(total)
        out: list[list[tuple[int, torch.Tensor]]] = []
        chunk, offset = 0, 0
        for n in sizes:
            parts, start = [], 0
            while start < n:
                if offset == self.chunks[chunk].numel():
                    chunk, offset = chunk + 1, 0
                take = min(n - start, self.chunks[chunk].numel() - offset)
                parts.append((start, self.chunks[chunk][offset : offset + take]))
                start, offset = start + take, offset + take
            out.append(parts)
        return out
