"""``rollout.speculative``: the engines decode speculatively with the checkpoint's own multi-token-prediction
(MTP) layer as the draft (sglang 0.5.23 EAGLE with a top-1 chain, ``rollout.speculative_steps`` draft
tokens per target verify), and ``model.mtp``: that MTP layer is part of the trained model, trained with
``gspo.mtp_loss_coef`` and sent by every weight sync to the engines' draft (the sync stream carries it
under its HF names ``model.layers.{N}.*``, N = num_hidden_layers).

Engine flags (:meth:`Speculative.engine_args`), as sglang 0.5.23 resolves them:

- ``--speculative-algorithm EAGLE``: ``NEXTN`` is an alias that ``arg_groups/speculative_hook.py``
  ``_resolve_speculative_algorithm_alias`` turns into ``EAGLE`` (``srt/speculative/spec_registry.py``
  ``_RESERVED_ALIASES = {"NEXTN"}``, ``spec_info.py`` ``SpeculativeAlgorithm.from_string``), so
  ``/server_info`` reports ``EAGLE`` either way; the trainer asks for ``EAGLE`` so that an attached engine's
  value compares equal.
- ``--speculative-num-steps rollout.speculative_steps``, ``--speculative-eagle-topk 1`` and
  ``--speculative-num-draft-tokens steps + 1``: with top-k 1 sglang sets ``num_draft_tokens = steps + 1``
  whatever was given (``_handle_eagle_family``, "speculative_num_draft_tokens is adjusted to
  speculative_num_steps + 1 when speculative_eagle_topk == 1"); with none of the three set it picks (3, 1, 4)
  for these architectures (``_auto_choose_speculative_params``).
- no ``--speculative-draft-model-path``: for the DeepSeek-V3 / GLM-4.5 architectures sglang defaults it to
  ``--model-path`` (``_handle_eagle_family``: "DeepSeek MTP does not require setting
  speculative_draft_model_path"); for Qwen3-Next / Qwen3.5 it stays unset and the draft worker reads
  ``--model-path`` (``ModelConfig.from_server_args``: ``model_path or cfg.model_path``; the family attribute
  ``sglang_draft_path_defaulted`` says which); the draft is the MTP layer of the checkpoint directory, built with
  ``ModelConfig(is_draft_model=True)`` (``configs/model_config.py``: ``Glm4MoeForCausalLM`` ->
  ``Glm4MoeForCausalLMNextN``, ``DeepseekV3ForCausalLM`` -> ``DeepseekV3ForCausalLMNextN``), sharing the
  target's embedding and head (``speculative/eagle_worker_v2.py`` ``init_lm_head``: ``set_embed_and_head``).

What sglang 0.5.23 refuses or changes next to the flags this trainer sets (read in
``arg_groups/speculative_hook.py``, ``lora_hook.py``, ``attention_hook.py``, ``kv_cache_hook.py``,
``parallel_hook.py``): nothing the trainer derives is refused. ``--enable-return-routed-experts`` is
kept (the draft's capture is switched off: ``model_executor/model_runner.py``
``disable_routed_experts_capture_for_draft``); LoRA is allowed with EAGLE (``lora_hook.py``
``check_lora_speculative_compatibility`` refuses only ``--speculative-adaptive``, the
``experimental_sgl_trtllm`` MoE runner and ``SGLANG_ENABLE_OVERLAP_PLAN_STREAM``; the adapters apply to the
target, the draft runs unadapted); ``--enable-deterministic-inference`` is refused only with rejection
sampling off CUDA (not set here); DP attention is refused for STANDALONE only and page size > 1 only with
top-k > 1 (the trainer sets neither). sglang does reset ``max_running_requests`` to 48 when unset
(``_handle_eagle_family``), which would run a rollout of hundreds of sequences in waves of 48: with
``rollout.engine_max_running_requests`` 0 (auto) the trainer sets it to the requests a rollout sends at once
(:func:`max_running_requests`, passed by ``fleet/engine_args.py``), and :meth:`Speculative.notes` says which
value. The draft's weights and KV pool are counted in the plan's engine budget (:meth:`Speculative.engine_budget_rows`,
:meth:`Speculative.engine_kv_bytes_per_token`).

Refused here (one line each, :meth:`Speculative.config_errors` / :meth:`Speculative.model_errors`):
speculative without ``rollout.engine=sglang``; ``rollout.speculative_steps < 1``; ``gspo.mtp_loss_coef > 0``
without the MTP layer in the model; ``model.mtp=false`` with colocated engines (they release their weights
after every rollout, the draft's included, and nothing would send the published draft again);
``model.mtp`` with ``rollout.lora_sync=adapter`` (an adapter sync sends
only the adapters: the engines' draft would never get the trained MTP layer); a checkpoint whose family or
MTP layer count the draft cannot serve (``models.mtp.mtp_errors``) when the model holds the MTP layer or the
engines draft with it (``model.mtp=false`` with speculative keeps the published draft of the checkpoint
directory, which must have it).

Metrics: ``spec/engine_accept_length`` (sum of completion tokens / sum of verify forwards over a step, the
bonus token included: sglang's ``spec_accept_length``), ``spec/engine_accept_rate`` (sum of accepted draft
tokens / sum of proposed ones: ``spec_accept_rate``), both from the engines' ``meta_info``
(``engines/sglang_engine.py`` ``spec_counts`` keeps ``spec_verify_ct`` / ``spec_num_correct_drafts`` /
``spec_num_proposed_drafts`` on each RolloutSample, and ``engine_spec_metrics`` sums them over a step's
samples), and ``spec/draft_accept_rate`` (the trainer's own).
"""

from __future__ import annotations

import math
from typing import Any

from gspo_megatron.features.base import EngineFlag, Feature, PlanContext, Row
from gspo_megatron.features.inflight import inflight_slots
from gspo_megatron.wire_format import SPEC_DEFAULT_MAX_RUNNING

ALGORITHM = "EAGLE"  # what sglang resolves NEXTN to (module docstring)
_SPEC = "rollout.speculative"


def draft_tokens(steps: int) -> int:
    """``--speculative-num-draft-tokens`` for a top-1 chain of ``steps`` draft tokens: ``steps + 1`` (the
    verified token plus the drafts; sglang's ``_handle_eagle_family`` forces it for top-k 1)."""
    return int(steps) + 1


def speculative_server_args(steps: int) -> dict[str, Any]:
    """The sglang ``ServerArgs`` fields of MTP speculative decoding with ``steps`` draft tokens per verify."""
    return {
        "speculative_algorithm": ALGORITHM,
        "speculative_num_steps": int(steps),
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": draft_tokens(steps),
    }


def rollout_requests(cfg) -> int:
    """The generate requests a rollout sends at once, over all engines: a step's prompts (over-sampled:
    ``ceil(rollout.over_sample * prompts_per_step)`` with ``dynamic_sampling``, ``orchestration/batch.py``;
    with ``rollout.inflight_updates``, the in-flight groups, ``orchestration/inflight.py``) x ``group_size``."""
    r = cfg.rollout
    prompts = math.ceil(r.over_sample * r.prompts_per_step) if r.dynamic_sampling else r.prompts_per_step
    if r.inflight_updates != "off":
        prompts = max(prompts, inflight_slots(r))
    return int(prompts) * int(r.group_size)


def max_running_requests(cfg) -> int | None:
    """``--max-running-requests`` of the engines (``fleet/engine_args.py``): ``rollout.engine_max_running_requests``
    when set; 0 (auto) with ``rollout.speculative``: :func:`rollout_requests`, not below sglang's own 48;
    otherwise None (not set: sglang's limit from its KV cache)."""
    r = cfg.rollout
    if r.engine_max_running_requests > 0:
        return int(r.engine_max_running_requests)
    if r.speculative:
        return max(rollout_requests(cfg), SPEC_DEFAULT_MAX_RUNNING)
    return None


def _colocated(mode: str) -> bool:
    from gspo_megatron.features.sync_modes import SYNC_MODES

    sm = SYNC_MODES.get(mode)
    return sm is not None and sm.colocated


class Speculative(Feature):
    name = "speculative"
    field = _SPEC
    metrics = ("spec/engine_accept_length", "spec/engine_accept_rate", "spec/draft_accept_rate")
    flags = {
        "speculative_algorithm": EngineFlag(_SPEC),
        "speculative_num_steps": EngineFlag("rollout.speculative_steps"),
        "speculative_eagle_topk": EngineFlag(_SPEC),
        "speculative_num_draft_tokens": EngineFlag("rollout.speculative_steps (+ 1)"),
    }

    def enabled(self, cfg) -> bool:
        return bool(cfg.rollout.speculative) or cfg.mtp_in_model

    def config_errors(self, cfg) -> list[str]:
        r, e = cfg.rollout, []
        if r.speculative and r.engine != "sglang":
            e.append(
                f"rollout.speculative=true needs rollout.engine=sglang (sglang's EAGLE decoding with the MTP draft; "
                f"rollout.engine_server=cpu on CPU), got {r.engine}; set rollout.speculative=false"
            )
        if r.speculative and int(r.speculative_steps) < 1:
            e.append(f"rollout.speculative_steps={r.speculative_steps} must be >= 1 (draft tokens per verify, e.g. 3)")
        coef = float(cfg.gspo.mtp_loss_coef)
        if coef > 0 and not cfg.mtp_in_model:
            e.append(
                f"gspo.mtp_loss_coef={coef} needs the MTP layer in the trained model: set model.mtp=true "
                "(or leave it null with rollout.speculative=true), or gspo.mtp_loss_coef=0"
            )
        mtp_lr = cfg.optimizer.mtp_lr
        if mtp_lr is not None and (not cfg.mtp_in_model or float(mtp_lr) <= 0):
            e.append(
                f"optimizer.mtp_lr={mtp_lr} needs the MTP layer in the trained model (model.mtp=true, or null with "
                "rollout.speculative=true) and a value > 0; or leave it null (optimizer.lr)"
            )
        if r.speculative and not cfg.mtp_in_model and _colocated(r.sync_mode):
            e.append(
                f"rollout.speculative=true with model.mtp=false and rollout.sync_mode={r.sync_mode}: colocated engines "
                "release their weights after every rollout, the draft's MTP layer with them (sglang's memory saver "
                "frees every tensor its model runners loaded, the draft's too), and without model.mtp no sync sends "
                "that layer again; set model.mtp=true (with gspo.mtp_loss_coef=0 the published draft is sent "
                "unchanged) or a disaggregated rollout.sync_mode"
            )
        if cfg.mtp_in_model and cfg.model.lora.rank > 0 and r.lora_sync == "merged":
            e.append(
                "model.mtp=true with model.lora: LoRA adapters on the MTP layer are not built yet; set model.mtp=false "
                "(the engines keep the checkpoint's draft) or model.lora.rank=0"
            )
        if cfg.mtp_in_model and cfg.model.lora.rank > 0 and r.lora_sync == "adapter":
            e.append(
                "model.mtp=true with rollout.lora_sync=adapter: an adapter sync sends only the LoRA adapters, so the "
                "engines' draft would never get the trained MTP layer; set model.mtp=false (the engines keep the "
                "checkpoint's draft) or rollout.lora_sync=merged"
            )
        return e

    def model_errors(self, cfg, dims: Any) -> list[str]:
        """``models.mtp.mtp_errors`` of the model's config.json (read as ``validate_model_layout``'s callers
        read it, ``models.arch.model_hf_config``), each line prefixed with the setting that needs the MTP
        layer."""
        hf = _model_hf_config(cfg)
        if hf is None:
            return []
        from gspo_megatron.models.mtp import mtp_errors

        if cfg.model.mtp:
            who = "model.mtp=true"
        elif cfg.model.mtp is None:
            who = "rollout.speculative=true (model.mtp null: the MTP layer trained and synced)"
        else:
            who = "rollout.speculative=true with model.mtp=false (the engines draft with the checkpoint's MTP layer)"
        from gspo_megatron.models.mtp import mtp_layout_errors

        layout = mtp_layout_errors(cfg.parallel.pp, cfg.parallel.cp, hf) if cfg.mtp_in_model else []
        return [f"{who}: {why}" for why in mtp_errors(hf, trained=cfg.mtp_in_model)] + layout

    def engine_args(self, cfg, hf: dict | None, route_spec: Any) -> dict[str, Any]:
        if not cfg.rollout.speculative:
            return {}
        return speculative_server_args(cfg.rollout.speculative_steps)

    def engine_budget_rows(self, ctx: PlanContext) -> list[Row]:
        """The draft's own weights on each engine GPU: the checkpoint's MTP layers, split over the engine's
        TP ranks as the target's weights are (its embedding and head are the target's: not counted again)."""
        if not ctx.cfg.rollout.speculative or not ctx.mtp_layers:
            return []
        from gspo_megatron.features.fp8_sync import engine_param_bytes

        r = ctx.cfg.rollout
        per = engine_param_bytes(ctx.cfg)
        label = f"speculative draft: {ctx.mtp_layers} MTP layer ({'fp8' if per == 1 else 'bf16'}, / engine_tp {r.engine_tp})"
        return [(label, ctx.mtp_layers * ctx.mtp_layer_params * per / r.engine_tp)]

    def engine_kv_bytes_per_token(self, ctx: PlanContext) -> float:
        """The draft's KV cache: sglang's draft runner keeps a pool of its own over as many tokens as the
        target's (``mem_cache/kv_cache_configurator.py``: "Draft worker reuses target's full/swa sizes"; the
        requests' ``req_to_token_pool`` is shared, ``speculative/eagle_worker_v2.py``), one attention layer
        per MTP layer (``model_runner_components/spec_aux_hidden_state.py``: ``draft_kv_num_layers`` =
        ``num_nextn_predict_layers``), so each token of the target's cache costs this much more."""
        if not ctx.cfg.rollout.speculative:
            return 0.0
        return ctx.mtp_layers * ctx.kv_bytes_per_layer

    def notes(self, ctx: PlanContext) -> list[str]:
        if not ctx.cfg.rollout.speculative:
            return []
        r = ctx.cfg.rollout
        how = (
            "rollout.engine_max_running_requests"
            if r.engine_max_running_requests
            else f"auto: the requests a rollout sends at once; sglang 0.5.23 would cap it at {SPEC_DEFAULT_MAX_RUNNING}"
        )
        return [
            f"speculative decoding: each engine runs at most {max_running_requests(ctx.cfg)} requests at once ({how}); "
            "the draft's MTP layer and its KV cache (one attention layer per token) are counted in the engines' budget"
        ]


def _model_hf_config(cfg) -> dict | None:
    """The model's config.json as the config checks' callers read it (None when it cannot be read: the
    caller has refused that already)."""
    from gspo_megatron.models.arch import model_hf_config

    try:
        return model_hf_config(cfg)[0]
    except Exception:  # noqa: BLE001 - ConfigError / OSError: reported by the caller's own read
        return None


SPECULATIVE = Speculative()
