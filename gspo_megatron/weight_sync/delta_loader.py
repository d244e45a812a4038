"""The engine's side of delta sync: a custom weight loader that sglang 0.5.23 imports by dotted name.

sglang's extension point (``srt/model_executor/model_runner_components/weight_updater.py``,
``WeightUpdater.update_weights_from_tensor``): an engine started with
``--custom-weight-loader gspo_megatron.weight_sync.delta_loader.apply_deltas`` and called with
``update_weights_from_tensor(..., load_format="gspo_megatron.weight_sync.delta_loader.apply_deltas")``
runs ``dynamic_import(load_format)(model, named_tensors)`` on every TP rank, with the payload's
tensors already moved to the rank's device (``_unwrap_tensor``). A load_format that is not in the
server's ``--custom-weight-loader`` list raises ``NotImplementedError(f"Unknown load_format=...")``.
sglang's ``update_weights_from_distributed`` path never consults custom loaders (it always calls
``model.load_weights``), so delta sync runs only over ``update_weights_from_tensor``.

:func:`apply_deltas` rebuilds every HF tensor of the payload from this process's host copy (the
copy of what the trainer last sent, kept on the model object as ``_gspo_delta_copy``: name ->
(epoch, tensor)) and the payload's changed elements (``weight_sync.delta``), then calls
``model.load_weights`` once with the full HF-named tensors: sglang's own fusing (q/k/v, gate/up,
experts' w13 / w2) and TP / EP sharding apply exactly as for a full sync, so the engine's weights
are bitwise those of a full sync. Memory: the host copy is the model's bytes in the engine dtype,
per engine TP rank process (every TP rank is handed the full HF tensors and cuts its own shard).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from gspo_megatron.weight_sync.delta import decode_entries

#: the dotted name the engines are started with (``--custom-weight-loader``) and the load_format sent
LOADER_NAME = "gspo_megatron.weight_sync.delta_loader.apply_deltas"
COPY_ATTR = "_gspo_delta_copy"


def host_copy(model: Any) -> dict[str, tuple[int, torch.Tensor]]:
    """This engine process's copy of what the trainer last sent (created on first use)."""
    held = getattr(model, COPY_ATTR, None)
    if held is None:
        held = {}
        # nn.Module.__setattr__ stores a dict as a plain attribute (not a parameter or buffer)
        object.__setattr__(model, COPY_ATTR, held)
    return held


def apply_deltas(model: Any, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """sglang's custom-loader signature ``(model, named_tensors)``. ``named_tensors``: the wire
    entries of ``DeltaEncoder.encode_bucket`` (``weight_sync.delta``); the full tensors rebuilt
    from them go to ``model.load_weights`` in one call, on the device the payload arrived on, as
    copies (loaders may write into their input; the host copy must stay what was sent)."""
    named_tensors = list(named_tensors)
    if not named_tensors:
        return
    device = named_tensors[0][1].device
    full = decode_entries(named_tensors, host_copy(model))
    model.load_weights([(name, t.to(device, copy=True)) for name, t in full])
