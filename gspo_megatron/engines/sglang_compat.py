"""Every SGLang version shim in one place (slime style): import locations that moved between
versions, the torch reduction patch, the tensor-bucket class and the payload serializer.

Only the pure-Python weight-sync pieces of sglang are imported here (they import on CPU when sglang
is installed with ``--no-deps`` plus a few small packages; see the Makefile). Nothing here starts a
server. The trainer (``weight_sync.cuda_ipc``) and the CPU rollout server
(``cpu_server``) both serialize / deserialize through these functions, so the bytes a CPU
test moves are the bytes SGLang would read.

CPU tensors: torch's default ``file_descriptor`` sharing passes storages over a connection that
only a multiprocessing child can open; unrelated processes (trainer rank -> server TP rank) need
``file_system`` sharing (named shared-memory segments), set by :func:`use_cpu_shared_memory`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

SGLANG_VERSION_TESTED = "0.5.23"


def flattened_bucket_class() -> Any | None:
    """sglang's FlattenedTensorBucket (its location moved between versions), or None."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError:
        try:
            from sglang.srt.model_executor.model_runner import FlattenedTensorBucket
        except ImportError:
            return None
    return FlattenedTensorBucket


def flattened_metadata_class() -> Any | None:
    """sglang's FlattenedTensorMetadata (next to FlattenedTensorBucket), or None."""
    cls = flattened_bucket_class()
    if cls is None:
        return None
    import sys

    return getattr(sys.modules.get(cls.__module__), "FlattenedTensorMetadata", None)


def require_flattened_bucket_class() -> Any:
    """``flattened_bucket_class()`` where a payload says ``load_format="flattened_bucket"`` (its
    sender had the class); ImportError when this sglang lacks it."""
    cls = flattened_bucket_class()
    if cls is None:
        raise ImportError(
            "load_format flattened_bucket needs sglang's FlattenedTensorBucket, which does not import here"
        )
    return cls


def multiprocessing_serializer() -> Any:
    """sglang's MultiprocessingSerializer (ForkingPickler + base64); ImportError names the fix."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as e:
        raise ImportError(
            "weight sync by update_weights_from_tensor needs sglang's serializer "
            f"(pip install --no-deps sglang=={SGLANG_VERSION_TESTED}; see the Makefile for "
            "the few packages it imports)"
        ) from e
    return MultiprocessingSerializer


def patch_torch_reductions(tensors: Sequence[torch.Tensor]) -> None:
    """sglang's patch makes CUDA IPC handles carry the device UUID (processes see different
    CUDA_VISIBLE_DEVICES). Applied only for CUDA tensors: the patched reducer breaks CPU tensors,
    which get :func:`use_cpu_shared_memory` instead."""
    if any(t.is_cuda for t in tensors):
        try:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        except ImportError:
            from sglang.srt.patch_torch import monkey_patch_torch_reductions
        monkey_patch_torch_reductions()
    else:
        use_cpu_shared_memory()


def use_cpu_shared_memory() -> None:
    """CPU tensors pickled by ForkingPickler travel as named shared-memory segments, which any
    process on this host can open (the default passes file descriptors to multiprocessing children
    only)."""
    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_system":
        mp.set_sharing_strategy("file_system")
