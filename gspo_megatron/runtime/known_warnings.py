"""The third-party warnings a run is known to print, hidden from gspo-train's first screen.

Without Transformer Engine and Apex (always on the CPU path) Megatron warns at every import that it
falls back to its local implementations, and a few library-internal calls warn on every run. They
say nothing the user can act on, so ``gspo-train`` hides exactly these (by message and by the module
that issues them; every other warning, and every error, still shows) and prints one line of its own
instead (:func:`backend_note`). ``gspo-train --debug`` shows them all, and so does an explicit
``python -W ...`` / ``PYTHONWARNINGS`` (the user's own filters are left to decide).

Warnings our own calls caused are fixed where they are made, not listed here (e.g. models/build.py
passes Megatron the non-deprecated ``cuda_graph_scope``).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings

# (message regex, category, issuing module regex): matched from the start, as warnings.filterwarnings does
KNOWN: tuple[tuple[str, type[Warning], str], ...] = (
    # megatron.core.optimizer, .optimizer.optimizer, .optimizer.clip_grads, .models.backends,
    # .models.gpt.gpt_layer_specs, .distributed.fsdp...mixed_precision, at import or spec build
    (r"(Transformer Engine and Apex are|Apex is) not installed", UserWarning, r"megatron\."),
    # Megatron's own DistributedOptimizer.zero_grad reads .grad of its fp32 shard views (its source
    # says "throws grad-access warning")
    (
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        UserWarning,
        r"megatron\.core\.optimizer\.",
    ),
    # torch (2.13 here) deprecates the collectives Megatron's grad/param buffers call; its deprecation
    # wrapper reports them from its own c10d_logger frame
    (
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        FutureWarning,
        r"torch\.distributed\.c10d_logger$",
    ),
)


def hide_known_warnings(debug: bool) -> bool:
    """Install the filters for :data:`KNOWN` unless ``debug`` or the user set warning options
    (``-W`` / ``PYTHONWARNINGS``). Every rank calls it, before Megatron is imported. Returns
    whether they were installed."""
    if debug or sys.warnoptions:
        return False
    for message, category, module in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    return True


def backend_note(hidden: bool) -> str | None:
    """The one line that replaces Megatron's fallback warnings, or None when nothing falls back."""
    import torch

    suffix = " (their warnings hidden; --debug shows them)" if hidden else ""
    if not torch.cuda.is_available():
        return (
            "[gspo-train] CPU path: Transformer Engine / Apex absent, Megatron's local layer spec and "
            f"torch norms and optimizers in use{suffix}"
        )
    missing = [
        name
        for name, mod in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
        if importlib.util.find_spec(mod) is None
    ]
    if not missing:
        return None
    return f"[gspo-train] {' and '.join(missing)} not installed: Megatron's torch fallbacks in use{suffix}"
