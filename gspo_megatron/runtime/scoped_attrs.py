"""Scoped overrides of a library module's attributes, for the few library constructors that read a
module-level flag our code must see differently while it runs (Megatron-Core 0.16.1's
``multi_latent_attention.HAVE_TE`` without Transformer Engine, ``gated_delta_net.HAVE_FLA`` without
flash-linear-attention).

``with module_attrs(module, NAME=value, ...):`` sets the attributes for the block and restores the
previous values when it is left (an exception included). One process-wide re-entrant lock is held for
the block, so two threads never interleave their overrides and restores; code that reads the
attribute outside any such block (another thread) can still see the override while a block runs, so
use it only around code that runs once, at build time (a module's constructor), never around a
forward.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

_LOCK = threading.RLock()


@contextlib.contextmanager
def module_attrs(module: types.ModuleType, **values: Any) -> Iterator[None]:
    """Within the block ``module.<name>`` is ``values[name]`` for each name (each must exist);
    restored on exit."""
    with _LOCK:
        saved = {name: getattr(module, name) for name in values}  # AttributeError: a name it lacks
        try:
            for name, value in values.items():
                setattr(module, name, value)
            yield
        finally:
            for name, value in saved.items():
                setattr(module, name, value)
