"""``rollout.lora_sync=adapter`` with ``model.lora``: the engines keep the base weights (sent once,
unmerged) and receive only the LoRA adapters at each sync, loaded as an sglang LoRA adapter that every
request names (``weight_sync/lora_adapter.py``); ``merged`` (the default) sends merged weights through the
sync mode's transport instead."""

from __future__ import annotations

from typing import Any

from gspo_megatron.features.base import EngineFlag, Feature, PlanContext, Row
from gspo_megatron.features.sync_modes import modes_where

#: Megatron linear -> the HF modules (sglang's --lora-target-modules names) it becomes
HF_TARGETS = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "linear_q_proj": ("q_proj",),
    "linear_q_down_proj": ("q_a_proj",),
    "linear_q_up_proj": ("q_b_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "linear_kv_up_proj": ("kv_b_proj",),
}


def adapter_sync_refusal(cfg) -> str | None:
    """None when ``rollout.lora_sync=adapter`` is supported for ``cfg``, else why (one line)."""
    r, lora = cfg.rollout, cfg.model.lora
    if lora.rank <= 0:
        return "rollout.lora_sync=adapter needs model.lora (model.lora.rank > 0): there are no adapters to send"
    if r.engine != "sglang":
        return (
            f"rollout.lora_sync=adapter needs rollout.engine=sglang (sglang's /load_lora_adapter_from_tensors), got "
            f"{r.engine}; use rollout.lora_sync=merged"
        )
    sglang_modes = modes_where(engine="sglang")
    if r.sync_mode not in sglang_modes and not r.engine_urls:
        return (
            f"rollout.lora_sync=adapter needs rollout.sync_mode={' or '.join(sglang_modes)} (or rollout.engine_urls), "
            f"got {r.sync_mode}; use rollout.lora_sync=merged"
        )
    if r.sync_delta or r.sync_fp8:
        return (
            "rollout.lora_sync=adapter is not supported with rollout.sync_delta=true or rollout.sync_fp8=true "
            "(the base is sent once, unmerged, and the adapters in the model dtype); set them false or use "
            "rollout.lora_sync=merged"
        )
    why = moe_lora_refusal(lora.target_modules, moe=None)
    if why is not None:
        return why
    if r.max_staleness > 0:
        return (
            f"rollout.lora_sync=adapter is not supported with rollout.max_staleness={r.max_staleness}: each sync "
            "unloads the previous adapter version, which generations still in flight name (sglang refuses an "
            "unloaded lora_path); set rollout.max_staleness=0 or use rollout.lora_sync=merged"
        )
    return None


def _targets_routed(t: str, fc: str) -> bool:
    """Whether target entry ``t`` reaches the routed experts' ``fc`` (``models/lora.py`` ``matches``:
    a dotted suffix of ``...mlp.experts.linear_fcX``; ``shared_experts.*`` does not)."""
    return t == fc or t == f"experts.{fc}" or t.endswith(f".experts.{fc}")


def moe_lora_refusal(target_modules, moe: bool | None) -> str | None:
    """None unless ``model.lora.target_modules`` puts adapters on routed experts that sglang would drop.
    sglang 0.5.23 wraps an MoE layer (``FusedMoE``) with LoRA only when both ``gate_up_proj`` and
    ``down_proj`` are among the server's ``--lora-target-modules`` (``lora/lora_manager.py``
    ``init_lora_modules``); the engine's targets are :func:`engine_lora_args`'s (every entry's
    leaf: ``linear_fc1`` -> gate/up, ``linear_fc2`` -> down). Unwrapped, the experts' adapters are
    silently not applied while the trainer trains them. ``moe``: the model has routed experts (None:
    unknown, so only entries naming ``experts.*`` count)."""
    if moe is False:
        return None
    leaves = {t.split(".")[-1] for t in target_modules}
    explicit = moe is None
    for fc, other in (("linear_fc1", "linear_fc2"), ("linear_fc2", "linear_fc1")):
        routed = [t for t in target_modules if _targets_routed(t, fc) and (not explicit or "experts" in t)]
        if routed and other not in leaves:
            fix = [*target_modules, "experts." + other]
            return (
                f"rollout.lora_sync=adapter: model.lora.target_modules={list(target_modules)} puts adapters on the "
                f"routed experts' {fc} ({routed[0]}) but nothing on {other}; sglang wraps an MoE layer with LoRA only "
                "when both gate_up_proj and down_proj are LoRA targets, so the engine would drop them while the "
                f"trainer trains them: use model.lora.target_modules=[{','.join(fix)}] (or rollout.lora_sync=merged)"
            )
    return None


def engine_lora_args(cfg) -> dict[str, Any]:
    """sglang server args of an adapter-serving engine: ``--enable-lora --max-lora-rank R
    --lora-target-modules <HF modules> --max-loras-per-batch 2 --max-loaded-loras 2`` (the base and
    the current adapter per batch; during a sync the new version is loaded before the old is
    unloaded: two registered)."""
    targets = sorted({h for t in cfg.model.lora.target_modules for h in HF_TARGETS.get(t.split(".")[-1], ())})
    return dict(
        enable_lora=True,
        max_lora_rank=int(cfg.model.lora.rank),
        lora_target_modules=targets,
        max_loras_per_batch=2,
        max_loaded_loras=2,
    )


_LORA = "rollout.lora_sync=adapter"


class AdapterSync(Feature):
    name = "adapter_sync"
    field = "rollout.lora_sync"
    metrics = ("sync/adapter_bytes", "sync/lora_adapter_bytes", "sync/base_bytes")
    flags = {
        "enable_lora": EngineFlag(_LORA),
        "max_lora_rank": EngineFlag(_LORA, "at_least"),
        "lora_target_modules": EngineFlag(_LORA, "present", unlimited=("all",)),  # sglang's ["all"] holds every module
        "max_loras_per_batch": EngineFlag(_LORA, "at_least"),
        "max_loaded_loras": EngineFlag(_LORA, "at_least", unlimited=(None,)),  # None: sglang sets no limit
    }

    def enabled(self, cfg) -> bool:
        return cfg.model.lora.rank > 0 and cfg.rollout.lora_sync == "adapter"

    def config_errors(self, cfg) -> list[str]:
        if cfg.rollout.lora_sync != "adapter":
            return []
        why = adapter_sync_refusal(cfg)
        return [why] if why else []

    def model_errors(self, cfg, dims: Any) -> list[str]:
        """Routed experts sglang would leave without LoRA (:func:`moe_lora_refusal`, the model's own MoE)."""
        why = moe_lora_refusal(cfg.model.lora.target_modules, moe=bool(dims.moe_layers))
        return [why] if why else []

    def engine_args(self, cfg, hf: dict | None, route_spec: Any) -> dict[str, Any]:
        return engine_lora_args(cfg)

    def train_rows(self, ctx: PlanContext) -> list[Row]:
        """Colocated: the engines keep their (bf16) weights through training: the base is sent once."""
        if not ctx.colocated:
            return []
        kept = ctx.counts.total * 2 / ctx.cfg.rollout.engine_tp
        return [("engine weights kept (lora_sync=adapter: the base is sent once)", kept)]

    def engine_budget_rows(self, ctx: PlanContext) -> list[Row]:
        """sglang's LoRA memory pool: ``max_loras_per_batch`` (2, :func:`engine_lora_args`) adapters at the
        max rank, bf16, whole (every engine TP rank holds them unsplit: conservative)."""
        return [("engine LoRA pool (2 adapters, bf16; lora_sync=adapter)", 2 * 2 * ctx.adapter_params)]


ADAPTER_SYNC = AdapterSync()
