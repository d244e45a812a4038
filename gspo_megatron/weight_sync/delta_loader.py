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
are bitwise those of a full sync.

Memory: the host copy holds, per engine TP rank process, every HF tensor the rank loads, whole in
the engine dtype (each TP rank is handed the full tensors and cuts its own shard): the dense tensors,
and of the routed experts only those of its expert-parallel rank. Which experts a rank loads is
asked of sglang's own ``FusedMoE`` layer in the model (``layers/moe/fused_moe_triton/layer.py``:
``weight_loader`` skips an expert for which ``_map_global_expert_id_to_local_expert_id`` gives -1),
so with ``--ep-size`` E a rank keeps 1/E of the experts; the others are dropped before the copy and
before ``load_weights`` (which would skip them). sglang's model runner always installs expert location
metadata for the MoE classes that define ``get_model_config_for_expert_location`` (the trivial map by
default, EPLB's with ``--init-expert-location``); then ``weight_loader`` loads checkpoint (logical)
expert e of layer L into every physical slot ``logical_to_all_physical(L, e)`` that is local to the
rank, and the loader keeps e where any is, per layer. Where a parameter asks for every expert
(``_sglang_require_global_experts``) or the model has no such layer, every tensor is kept.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch

from gspo_megatron.features.delta_sync import (
    LOADER_NAME,  # noqa: F401 (the name sglang imports: this module's apply_deltas)
)
from gspo_megatron.models.registry import expert_weight
from gspo_megatron.weight_sync.delta import decode_entries

#: the dotted name the engines are started with (``--custom-weight-loader``) and the load_format sent
COPY_ATTR = "_gspo_delta_copy"
EXPERTS_ATTR = "_gspo_delta_loads_expert"


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
    full = decode_entries(named_tensors, host_copy(model), keep=_kept_tensors(model))
    if full:  # (a bucket of only other EP ranks' experts: sglang would skip every one)
        model.load_weights([(name, t.to(device, copy=True)) for name, t in full])


def _kept_tensors(model: Any) -> Callable[[str], bool] | None:
    """``decode_entries``' ``keep``: False for a routed expert this rank does not load; None: all."""
    loads = loads_expert(model)
    if loads is None:
        return None

    def keep(name: str) -> bool:
        found = expert_weight(name)
        if found is None:
            return True
        layer = _LAYER.search(name)
        return layer is None or loads(int(layer.group(1)), found[0])

    return keep


def loads_expert(model: Any) -> Callable[[int, int], bool] | None:
    """Whether this engine TP rank loads routed expert ``e`` (global, logical index) of layer ``layer``,
    by sglang's own rule, asked of the model's ``FusedMoE`` layers (module docstring); None when it
    loads every expert or the rule cannot be asked. Worked out once per model object."""
    if not hasattr(model, EXPERTS_ATTR):
        object.__setattr__(model, EXPERTS_ATTR, _loads_expert(model))
    return getattr(model, EXPERTS_ATTR)


#: the decoder layer of an HF tensor name (``model.layers.3.``, ``model.language_model.layers.3.``)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _loads_expert(model: Any) -> Callable[[int, int], bool] | None:
    modules = getattr(model, "modules", None)
    moes = [
        m for m in (modules() if modules is not None else ()) if hasattr(m, "_map_global_expert_id_to_local_expert_id")
    ]
    if not moes or all(getattr(m, "moe_ep_size", 1) <= 1 for m in moes):
        return None
    if any(getattr(p, "_sglang_require_global_experts", False) for m in moes for p in m.parameters(recurse=False)):
        return None
    by_layer = {getattr(m, "layer_id", None): m for m in moes}

    def loads(layer: int, e: int) -> bool:
        moe = by_layer.get(layer)
        if moe is None:  # not an MoE layer of sglang's model (or one it names otherwise): keep
            return True
        return _loaded_by(moe, e)

    return loads


def _loaded_by(moe: Any, e: int) -> bool:
    """``FusedMoE.weight_loader``'s choice (``layers/moe/fused_moe_triton/layer.py``) for logical expert
    ``e``: without expert location metadata the local id ``_map_global_expert_id_to_local_expert_id(e)``
    (-1: skipped); with it, every physical slot of ``e`` in this layer (``logical_to_all_physical``)
    that maps to a local id in ``[0, num_local_experts)`` (``_weight_loader_physical``). A fused
    shared expert (``e`` past the logical routed experts) is kept."""
    meta = _expert_location_metadata(moe)
    local = moe._map_global_expert_id_to_local_expert_id
    if meta is None:
        return local(e) != -1
    if e >= meta.num_logical_experts:
        return True
    return any(0 <= local(p) < moe.num_local_experts for p in meta.logical_to_all_physical(moe.layer_id, e))


def _expert_location_metadata(moe: Any) -> Any:
    """sglang's EPLB expert placement when the layer uses it (``FusedMoE.weight_loader``'s test)."""
    if not getattr(moe, "uses_expert_location", False):
        return None
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    return get_global_expert_location_metadata()
