"""Per-step GPU memory and utilization metrics via NVML (nvidia-ml-py), a quiet no-op elsewhere.

``GpuMonitor().sample()`` -> ``{"gpu/mem_used_gb": max over local GPUs, "gpu/mem_used_gb_mean",
"gpu/mem_total_gb", "gpu/util_pct": max, "gpu/util_pct_mean", "gpu/torch_max_alloc_gb"}``
(the last from this process's CUDA caching allocator). Without pynvml, without a driver
(NVMLError_LibraryNotFound) or without GPUs it returns ``{}`` and never raises. Any rank may call it;
the trainer usually logs rank 0's (node-local) view.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)
_GB = 1024**3


def _visible_indices(count: int) -> list[int]:
    """NVML indices of this process's GPUs: CUDA_VISIBLE_DEVICES when it lists integers, else all."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None or env.strip() == "":
        return list(range(count))
    try:
        idx = [int(x) for x in env.split(",") if x.strip()]
    except ValueError:  # UUIDs / MIG names: fall back to every device NVML sees
        return list(range(count))
    return [i for i in idx if 0 <= i < count]


class GpuMonitor:
    """Opens NVML once; ``sample()`` is cheap (a few NVML calls per GPU)."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in _visible_indices(count)]
            self._nvml = pynvml
        except Exception as e:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded...
            logger.debug("GPU monitor disabled: %s", e)
            self._nvml, self._handles = None, []

    @property
    def enabled(self) -> bool:
        return self._nvml is not None and bool(self._handles)

    def sample(self) -> dict[str, float]:
        """Current metrics, or ``{}`` when disabled or NVML fails mid-run."""
        if not self.enabled:
            return {}
        try:
            used, total, util = [], [], []
            for h in self._handles:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
                used.append(mem.used / _GB)
                total.append(mem.total / _GB)
                util.append(float(self._nvml.nvmlDeviceGetUtilizationRates(h).gpu))
        except Exception as e:  # noqa: BLE001 - a metric, never a reason to stop training
            logger.debug("NVML query failed: %s", e)
            return {}
        out = {
            "gpu/mem_used_gb": max(used),
            "gpu/mem_used_gb_mean": sum(used) / len(used),
            "gpu/mem_total_gb": max(total),
            "gpu/util_pct": max(util),
            "gpu/util_pct_mean": sum(util) / len(util),
        }
        if torch.cuda.is_available():
            out["gpu/torch_max_alloc_gb"] = torch.cuda.max_memory_allocated() / _GB
        return out

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # noqa: BLE001 - shutting down the monitor
                pass
            self._nvml, self._handles = None, []
