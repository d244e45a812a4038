"""Global names of a model chunk's parameters: the layer and expert indices of this rank's chunk
(pipeline stage, expert-parallel slice) turned into the whole model's. Used by the export mapping
(``models/weights.py``) and by LoRA's seeding (``models/lora.py``), which is why it lives below both.
"""

from __future__ import annotations

import re

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.transformer_layer\.")  # models/mtp.py: its global index is k
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"(\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def global_names(model) -> dict[str, str]:
    """Map each local parameter name of ``model`` (one GPTModel chunk) to its global name."""
    out = {}
    layers = model.decoder.layers if hasattr(model, "decoder") else []
    for name, _ in named_tensors(model):
        g = name
        m = LAYER.match(name)
        if m:
            layer = layers[int(m.group(1))]
            g = f"decoder.layers.{layer.layer_number - 1}." + name[m.end() :]
            experts = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
            if experts is not None:
                g = _LOCAL_EXPERT.sub(lambda e: f".mlp.experts.local_experts.{experts[int(e.group(1))]}.", g)
                g = _GROUPED_EXPERT.sub(lambda e: f"{e.group(1)}{experts[int(e.group(2))]}", g)
        m = MTP_LAYER.match(name)
        if m:  # the MTP layer's experts: global expert indices, as the decoder's
            layer = getattr(model, "mtp").layers[int(m.group(1))].transformer_layer
            drafts = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
            if drafts is not None:
                g = _LOCAL_EXPERT.sub(lambda e: f".mlp.experts.local_experts.{drafts[int(e.group(1))]}.", g)
                g = _GROUPED_EXPERT.sub(lambda e: f"{e.group(1)}{drafts[int(e.group(2))]}", g)
        out[name] = g
    return out


def named_tensors(model):
    """named_parameters, then named_buffers (a buffer is moved only when a mapping rule names it)."""
    yield from model.named_parameters()
    yield from model.named_buffers()
