"""Reading tensors of an HF safetensors directory (single file or sharded with an index) for
``models.weights.load_hf_weights`` and the carried tensors (``models.carried``)."""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import torch

from gspo_megatron.checkpoint.safetensors_shards import memory_bytes, pread_into


class SafetensorsReader:
    """Reads named tensors from an HF directory (single file or sharded with an index).

    ``get`` returns safetensors' zero-copy view of the memory-mapped file. ``copy_into(dst, src)``
    fills a parameter (or a contiguous block of one) from such a view with ``pread`` into the
    parameter's memory when ``src`` is a contiguous run of the file in ``dst``'s dtype, else with
    ``dst.copy_(src)``. Going around safetensors here: copying out of its mmap page-faults every
    4 KiB page of the file into this process (1.2 s of a 1.7 s conversion of 246 MB on a busy
    2-core machine, against 0.1-0.5 s for ``pread`` of the same bytes, which the kernel copies from
    its page cache the way ``cp`` does). The file offset of a view comes from the file's header
    (8-byte length + JSON, the safetensors format) and the view's distance from the tensor ``get``
    returned."""

    def __init__(self, hf_dir: str):
        from safetensors import safe_open

        self.hf_dir = hf_dir
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self.where = json.load(f)["weight_map"]
        elif os.path.exists(single):
            with safe_open(single, "pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {hf_dir}")
        self._open: dict[str, Any] = {}  # file -> its safetensors ``safe_open`` handle
        self._fds: dict[str, int] = {}
        self._offsets: dict[str, dict[str, int]] = {}  # file -> tensor -> absolute byte offset
        # the last tensors ``get`` returned, kept alive (so no other tensor can take their
        # addresses): (tensor, fd, file offset)
        self._recent: list[tuple[torch.Tensor, int, int]] = []
        self._safe_open = safe_open

    def names(self) -> list[str]:
        return list(self.where)

    def _file(self, name: str):
        if name not in self.where:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {self.hf_dir}")
        fname = self.where[name]
        if fname not in self._open:
            path = os.path.join(self.hf_dir, fname)
            try:
                self._open[fname] = self._safe_open(path, "pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types; one line naming the file
                raise ValueError(f"cannot read {path}: {e}") from None
        return self._open[fname]

    def _locate_file(self, fname: str) -> tuple[int, dict[str, int]]:
        if fname not in self._fds:
            path = os.path.join(self.hf_dir, fname)
            fd = os.open(path, os.O_RDONLY)
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, n, 8))
            header.pop("__metadata__", None)
            self._fds[fname] = fd
            self._offsets[fname] = {k: 8 + n + v["data_offsets"][0] for k, v in header.items()}
        return self._fds[fname], self._offsets[fname]

    def get(self, name: str) -> torch.Tensor:
        t = self._file(name).get_tensor(name)
        fd, offsets = self._locate_file(self.where[name])
        if name in offsets and t.numel():
            self._recent = self._recent[-7:] + [(t, fd, offsets[name])]
        return t

    def get_row(self, name: str, index: int) -> torch.Tensor:
        """``get(name)[index]``, reading only that row from disk (one expert of a stacked tensor)."""
        return self._file(name).get_slice(name)[index : index + 1][0]

    def copy_into(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` (same shapes), by ``pread`` where ``src`` is a run of a file."""
        if dst.dtype == src.dtype and dst.device.type == "cpu" and dst.numel():
            if dst.is_contiguous() and src.is_contiguous():
                where = self._where(src)
                if where is not None:
                    pread_into(where[0], memory_bytes(dst), where[1], f"a safetensors file in {self.hf_dir}")
                    return
            elif dst.dim() > 1 and dst.shape[0] <= 4096 and dst[0].is_contiguous() and src[0].is_contiguous():
                for d, s_ in zip(dst, src):  # e.g. one query group of a fused QKV at a time
                    self.copy_into(d, s_)
                return
        dst.copy_(src)

    def _where(self, src: torch.Tensor) -> tuple[int, int] | None:
        p, n = src.data_ptr(), src.numel() * src.element_size()
        for t, fd, offset in self._recent:
            base, size = t.data_ptr(), t.numel() * t.element_size()
            if base <= p and p + n <= base + size:
                return fd, offset + (p - base)
        return None

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._recent = []
