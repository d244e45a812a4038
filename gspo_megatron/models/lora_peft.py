"""A LoRA checkpoint's adapters as a PEFT adapter directory (``tools/megatron_to_hf.py --lora-format peft``).

PEFT's LoRA on an ``nn.Linear`` ``W``: [out, in] is ``y = W x + s B A x`` with ``lora_A.weight``
``A``: [r, in], ``lora_B.weight`` ``B``: [out, r], ``s = lora_alpha / r`` -- the same factors and
scaling as ``models/lora.py``; the files:

- ``adapter_config.json``: ``peft_type: LORA``, ``task_type: CAUSAL_LM``, ``r``, ``lora_alpha``,
  ``lora_dropout``, ``target_modules`` (the exact list of HF module paths that have adapters, so
  PEFT adds none elsewhere), ``base_model_name_or_path``, ``bias: none``, ``use_rslora: false``;
- ``adapter_model.safetensors``: ``base_model.model.<HF module>.lora_A.weight`` / ``.lora_B.weight``
  for every HF module (``<HF module>`` = the HF weight name the family's mapping gives the base
  weight, without ``.weight``), in the checkpoint's dtype.

Megatron's fused linears map onto several HF modules by the *base weight's own rule*
(``models/mapping.py``):

- a column-parallel fused base (``linear_qkv`` -> q/k/v, ``linear_fc1`` -> gate/up; any rule that
  splits or permutes W's rows: ``FusedQKV``, ``GatedFC1``, ``PermutedRows``): ``delta = B A`` has
  the rows of B, so HF module i gets ``B_i`` = the rule applied to B's rows (``rule.from_shards([B])``
  exactly as to W) and the *shared* ``A`` duplicated: ``W_i + s B_i A`` is HF's merged weight i;
- a row-parallel base (``linear_proj`` -> o_proj, ``linear_fc2`` -> down_proj): one HF module,
  A and B as they are (the rule only renames the columns' owner);
- routed experts are refused here (``peft_tensors(experts=True)``, the adapter sync, names them
  per expert ``...mlp.experts.<e>.{gate,up,down}_proj``, which sglang loads): transformers 5 keeps each layer's experts fused in 3-D parameters
  (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], e.g. ``Qwen3MoeExperts``), not
  per-expert ``nn.Linear`` modules, so PEFT can adapt them only through ``LoraConfig.target_parameters``
  (``ParamWrapper``: ``lora_A`` [E r, in], ``lora_B`` [out, r E], no dropout), which this export
  does not write; export merged (the default) for them.

The model is this process's full copy (tp = pp = ep = 1: every A and B whole; the adapters are a
small part of the checkpoint, but the frozen base is built too).
"""

from __future__ import annotations

import json
import os

import torch

from gspo_megatron.models.lora import lora_modules
from gspo_megatron.models.lora_base import seed_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
#: sglang's fused LoRA modules and the HF modules stacked in them, in row order (``srt/lora/lora.py``
#: ``normalize_qkv_proj`` / ``normalize_gate_up_proj``)
SGLANG_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class PeftExportError(ValueError):
    """A LoRA checkpoint that has no PEFT form here (routed-expert adapters; a rule we cannot split)."""


def _module(hf_weight: str) -> str:
    if not hf_weight.endswith(".weight"):
        raise PeftExportError(f"HF tensor {hf_weight} is not a linear weight")
    return hf_weight[: -len(".weight")]


def module_pieces(
    rule, hf_names, gname: str, column: bool, a_shards, b_shards
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF module, A, B) of one LoRA linear from its (E)TP shards (one shard each at tp 1): a
    column-parallel base's B rows are gathered by the base weight's own rule (``rule.from_shards``,
    A replicated); a row-parallel base's A columns are concatenated (B replicated)."""
    from gspo_megatron.models.mapping import RowParallel

    if column:  # rows of B follow the rows of W; A is shared by every part
        A = a_shards[0]
        parts = rule.from_shards(list(b_shards))
        if len(parts) != len(hf_names) or any(p.shape[1] != A.shape[0] for p in parts):
            raise PeftExportError(f"--lora-format peft: {gname}'s rule {type(rule).__name__} does not split rows")
        return [(_module(h), A, p) for h, p in zip(hf_names, parts)]
    if type(rule) is not RowParallel or len(hf_names) != 1:
        raise PeftExportError(
            f"--lora-format peft: {gname}'s rule {type(rule).__name__} is not a plain row-parallel rename"
        )
    A = a_shards[0] if len(a_shards) == 1 else torch.cat(list(a_shards), dim=1)
    return [(_module(hf_names[0]), A, b_shards[0])]


def routed_refusal(model, gname: str) -> PeftExportError:
    return PeftExportError(
        f"--lora-format peft: the checkpoint's model.lora.target_modules {(model.lora or {}).get('target_modules')} put adapters on "
        f"the routed experts ({gname}); transformers 5 holds a layer's experts in fused 3-D parameters "
        "(mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]), not per-expert nn.Linear modules, so "
        "PEFT needs LoraConfig.target_parameters for them, which this export does not write: export the "
        "merged model (--lora-format merged) or train without expert adapters (e.g. target_modules: "
        "[linear_qkv, linear_proj])"
    )


@torch.no_grad()
def peft_tensors(model, experts: bool = False) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(PEFT tensor name -> tensor, HF module paths with adapters) of ``model`` (one GPTModel with
    LoRA, built in one process: tp = pp = ep = 1). Raises PeftExportError for routed experts unless
    ``experts`` (sglang's per-expert names ``...mlp.experts.<e>.{gate,up,down}_proj``: the mapping's
    HF names; adapter sync)."""
    from gspo_megatron.models.registry import get_family

    mapping = get_family(model.hf_config).mapping(model.hf_config)
    out: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    for _, m in lora_modules(model):
        gname = m.lora_global_name
        if ".experts.local_experts." in seed_name(gname) and not experts:  # routed, either spec
            raise routed_refusal(model, gname)
        rule, hf_names = mapping.resolve(gname)
        for mod, a, b in module_pieces(rule, hf_names, gname, m.lora_column, [m.lora_A.detach()], [m.lora_B.detach()]):
            out[f"{PEFT_PREFIX}{mod}.lora_A.weight"] = a.contiguous().clone()
            out[f"{PEFT_PREFIX}{mod}.lora_B.weight"] = b.contiguous().clone()
            modules.append(mod)
    return out, modules


def peft_config(lora: dict, modules: list[str], base_model: str | None) -> dict:
    """adapter_config.json for ``lora`` (a checkpoint's model.lora metadata) and its HF modules."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": int(lora["rank"]),
        "lora_alpha": lora["alpha"],
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def save_peft_dir(out_dir: str, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """``out_dir``/adapter_model.safetensors and adapter_config.json (what peft and sglang's
    ``LoRAConfig`` / ``LoRAAdapter.initialize_weights`` read)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def write_peft_dir(model, lora: dict, out_dir: str, base_model: str | None) -> list[str]:
    """Write ``model``'s adapters as a PEFT directory at ``out_dir``; returns the HF modules."""
    tensors, modules = peft_tensors(model)
    save_peft_dir(out_dir, tensors, peft_config(lora, modules, base_model))
    return modules


def export_peft(checkpoint: str, output: str, base_model: str | None) -> list[str]:
    """Load ``checkpoint`` (a LoRA checkpoint; one process, tp = pp = ep = 1, after init_distributed)
    and write its adapters as a PEFT directory at ``output``. Returns the HF modules with adapters."""
    from gspo_megatron.convert import checkpoint_meta, gc_paused, load_model

    _, meta = checkpoint_meta(checkpoint)
    if not meta.get("lora"):
        raise PeftExportError(
            f"--lora-format peft: {checkpoint} has no LoRA adapters (its metadata has no "
            "model.lora); export it merged (the default)"
        )
    with gc_paused():
        model, _ = load_model(checkpoint, 1, 1, 1, None, 1)
        return write_peft_dir(model, meta["lora"], output, base_model)
