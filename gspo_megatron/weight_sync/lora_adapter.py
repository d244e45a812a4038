"""Adapter-only LoRA sync (``rollout.lora_sync=adapter``): the engines keep the frozen base and each
sync sends only the adapters, as a new sglang LoRA adapter that every rollout request names.

Per sync (:class:`AdapterSyncer`, a :class:`~gspo_megatron.weight_sync.sync.WeightSyncer`):

- when the engines do not hold the base (the first sync, after an engine restart or a failed sync):
  the export stream runs as for a merged sync but *unmerged* (:func:`base_export`: the LoRA base
  weights export their own ``W``), through the run's transport: the engines then hold the trainer's
  base, whatever ``--model-path`` held (a resumed run's base is the checkpoint's);
- then the adapters, gathered to rank 0 in any layout (:func:`gathered_peft_tensors`: each LoRA
  linear's sharded factor all-gathered over its (E)TP group, the export plan's owner of the base
  weight contributing it, PP stages their layers, EP ranks their experts by global index), in PEFT
  names (``models.lora_peft.module_pieces``: fused ``linear_qkv`` / ``linear_fc1`` split into q/k/v and
  gate/up with A shared, sent fused by :func:`fuse_shared_a`, which sglang's ``normalize_qkv_proj`` /
  ``normalize_gate_up_proj`` stack back; routed experts as sglang's per-expert
  ``...mlp.experts.<e>.{gate,up,down}_proj``) and ``peft_config`` (r, lora_alpha, target_modules),
  loaded on every engine as ``<name>-v<N>`` (N: the sync's weight version; sglang refuses a name
  already loaded); then ``POST /unload_lora_adapter`` of the previous version and
  ``/update_weight_version`` (the sync check's version); from then on every request of the rollout
  engine carries ``lora_path`` = ``<name>-v<N>`` (``SGLangRolloutEngine.lora_path``), the sync probe's
  too, so the probe compares the adapter-serving engine with the trainer.

Transport of the adapter:
- colocated: ``POST /load_lora_adapter_from_tensors`` with the adapter *by value* (:func:`by_value_payload`):
  every engine TP rank deserializes its own item of ``serialized_named_tensors`` (sglang's
  ``tp_worker.py`` ``deserialize_own_rank``: ``MultiprocessingSerializer.deserialize``, a ``SafeUnpickler``)
  and slices its part. Not ForkingPickler (``MultiprocessingSerializer.serialize``): it puts a CPU tensor
  in a shared-memory segment of rank 0's host (a CUDA tensor in a CUDA IPC handle), which a TP rank on
  another node (an engine spanning nodes, an engine on another node's GPUs) cannot open. The plain pickle
  of CPU tensors carries their bytes (``torch._utils._rebuild_tensor_v2`` over ``torch.storage._load_from_bytes``,
  both on SafeUnpickler's allow-list, the latter read by its ``_safe_load_torch_storage``): one payload,
  the same string for every TP rank;
- engines elsewhere (``sync_mode=disaggregated`` or ``rollout.engine_urls``; ``adapter_dir`` set):
  neither opens on another host, so each version is written as a PEFT directory
  ``<adapter_dir>/<name>-v<N>`` (adapter_config.json + adapter_model.safetensors, renamed into place)
  and loaded with sglang's ``POST /load_lora_adapter {lora_name, lora_path}``; the directory must be
  visible at that path on the engine hosts; the previous version's directory is removed after its
  unload.

Colocated memory: the engines release only their KV cache after a rollout (the rollout engine's
``memory_tags``), not the weights: sglang's memory saver drops released weights' contents, and the
base is not sent again.

Refused (``features.adapter_sync.adapter_sync_refusal``, one line naming the fields): without ``model.lora``; engines
other than sglang; sync modes other than colocated / disaggregated (without ``rollout.engine_urls``);
``rollout.sync_delta`` / ``rollout.sync_fp8``; routed-expert adapters on one of ``linear_fc1`` /
``linear_fc2`` only (``features.adapter_sync.moe_lora_refusal``: sglang would drop them).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from gspo_megatron.models.lm_head import unwrap_gpt
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.runtime.distributed import any_rank
from gspo_megatron.weight_sync.sync import WeightSyncer, _gather_to_rank0, _lora_of

ADAPTER_NAME = "policy"


def by_value_payload(tensors: dict) -> str:
    """The adapter as one ``serialized_named_tensors`` item that carries its bytes: the plain pickle
    (not ForkingPickler) of the CPU tensors, base64, which sglang's ``MultiprocessingSerializer.deserialize``
    reads on any node (see the module docstring). Each tensor is cloned, so it pickles exactly its own
    bytes (a view would carry its whole storage)."""
    import base64
    import pickle

    named = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return base64.b64encode(pickle.dumps(named, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


@contextlib.contextmanager
def base_export(model) -> Iterator[None]:
    """Inside, the export stream reads every LoRA base weight as its own ``W`` (not ``W + s B A``)."""
    from gspo_megatron.models.lora import lora_modules

    saved = []
    for _, m in lora_modules(model):
        fn = m.weight.__dict__.pop("lora_merged", None)
        if fn is not None:
            saved.append((m.weight, fn))
    try:
        yield
    finally:
        for w, fn in saved:
            w.lora_merged = fn


def fuse_shared_a(tensors: dict, modules: list[str]) -> tuple[dict, list[str]]:
    """The PEFT export's q/k/v (gate/up) parts of one fused Megatron linear share one A: send them as
    sglang's already-fused ``qkv_proj`` (``gate_up_proj``) with that A once and B stacked [q; k; v]
    (HF row order), which sglang's ``normalize_qkv_proj`` / ``normalize_gate_up_proj`` read by
    repeating A 3x / 2x (``srt/lora/lora.py``): the bytes of one A instead of three (two)."""
    from gspo_megatron.models.lora_peft import SGLANG_FUSED

    out, mods = dict(tensors), list(modules)
    for fused, parts in SGLANG_FUSED.items():
        for mod in [m for m in modules if m.endswith("." + parts[0])]:
            prefix = mod[: -len(parts[0])]
            names = [prefix + p for p in parts]
            keys = [f"base_model.model.{n}.lora_{{}}.weight" for n in names]
            if not all(k.format("A") in out for k in keys):
                continue
            a = out[keys[0].format("A")]
            if not all(out[k.format("A")] is a or out[k.format("A")].equal(a) for k in keys):
                continue
            b = torch.cat([out[k.format("B")] for k in keys], 0)
            for k in keys:
                del out[k.format("A")], out[k.format("B")]
            out[f"base_model.model.{prefix}{fused}.lora_A.weight"] = a
            out[f"base_model.model.{prefix}{fused}.lora_B.weight"] = b
            mods = [m for m in mods if m not in names] + [prefix + fused]
    return out, sorted(mods)


@torch.no_grad()
def gathered_peft_tensors(model, plan=None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The whole adapter in PEFT names, as CPU tensors, on rank 0 (({}, []) elsewhere), in any
    parallel layout. Collective: every rank calls it. Per LoRA linear of this rank (PP: the stage's
    layers; EP: the rank's experts, named by global index): the (E)TP all-gather of its sharded
    factor over the linear's own ``tp_group`` (column: B's row shards, assembled by the base weight's
    rule as the merged export does; row: A's column shards), run by the ranks the export plan holds
    the base weight on (``mine``: the first data-parallel replica); the plan's owner of the base
    weight (``build_export_plan``: one rank per weight) contributes the result, and one
    ``gather_object`` brings every owner's adapters to rank 0."""
    from gspo_megatron.models.lora import lora_modules
    from gspo_megatron.models.lora_peft import PEFT_PREFIX, module_pieces
    from gspo_megatron.models.registry import get_family

    gpt = unwrap_gpt(model)
    mapping = get_family(gpt.hf_config).mapping(gpt.hf_config)
    world = rdist.world_size()
    if world > 1 and plan is None:
        from gspo_megatron.models.weights import build_export_plan

        plan = build_export_plan(gpt)
    owner = {it.global_name: it.owner for it in plan[0]} if world > 1 else {}
    mine = plan[1] if world > 1 else None
    me = rdist.rank()
    out: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    errors: list[str] = []
    for _, m in lora_modules(gpt):
        gname = m.lora_global_name
        if mine is not None and gname not in mine:  # not the first data-parallel replica
            continue
        is_col = m.lora_column
        sharded = m.lora_B if is_col else m.lora_A
        group = m.lora_tp_group
        size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        if size > 1:
            shards = [torch.empty_like(sharded) for _ in range(size)]
            dist.all_gather(shards, sharded.detach().contiguous(), group=group)
        else:
            shards = [sharded.detach()]
        if world > 1 and owner.get(gname, 0) != me:
            continue
        if errors:  # keep joining the collectives; the first error is reported on rank 0
            continue
        a_shards, b_shards = ([m.lora_A.detach()], shards) if is_col else (shards, [m.lora_B.detach()])
        try:
            rule, hf_names = mapping.resolve(gname)
            pieces = module_pieces(rule, hf_names, gname, is_col, a_shards, b_shards)
        except Exception as e:  # noqa: BLE001 - raised on rank 0 after the gather (no rank left waiting)
            errors.append(f"rank {me}: {type(e).__name__}: {e}")
            continue
        for mod, a, b in pieces:
            out[f"{PEFT_PREFIX}{mod}.lora_A.weight"] = a.detach().to("cpu").contiguous().clone()
            out[f"{PEFT_PREFIX}{mod}.lora_B.weight"] = b.detach().to("cpu").contiguous().clone()
            modules.append(mod)
    parts = _gather_to_rank0((out, modules, errors)) if world > 1 else [(out, modules, errors)]
    if me != 0:
        return {}, []
    tensors: dict[str, torch.Tensor] = {}
    mods: list[str] = []
    for t, ms, errs in parts:
        if errs:
            raise ValueError(f"rollout.lora_sync=adapter: the adapter has no PEFT form: {errs[0]}")
        tensors.update(t)
        mods.extend(x for x in ms if x not in mods)
    return tensors, mods


class AdapterSyncer(WeightSyncer):
    """``rollout.lora_sync=adapter``'s syncer (module docstring). ``engine``: rank 0's
    ``SGLangRolloutEngine`` (None elsewhere)."""

    def __init__(
        self,
        model,
        topology,
        bucket_mb: float = 512.0,
        engine=None,
        name: str = ADAPTER_NAME,
        adapter_dir: str | None = None,
    ):
        super().__init__(model, topology, bucket_mb)
        self.adapter_dir = adapter_dir  # set: engines elsewhere, a PEFT directory per version + /load_lora_adapter
        if _lora_of(model) is None:
            raise ValueError("rollout.lora_sync=adapter: the model has no LoRA adapters (model.lora.rank 0)")
        self.engine, self.name = engine, name
        self.base_on_engines = False
        self.current: str | None = None  # the adapter the engines serve

    def engines_restarted(self) -> None:
        super().engines_restarted()
        self.base_on_engines = False

    def sync(self) -> dict:
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        base_bytes = 0.0
        if not self.base_on_engines:
            with base_export(unwrap_gpt(self.model)):
                metrics = super().sync()  # numbers the version; self.errors on rank 0 after a failure
            if any_rank(bool(self.errors)):
                self.engines_restarted()
                return metrics
            base_bytes = metrics.get("sync/bytes_total", 0.0)
        else:
            self.version += 1
        error, sent = None, 0
        try:  # collective: the (E)TP gathers and the gather to rank 0 (gathered_peft_tensors)
            tensors, modules = gathered_peft_tensors(self.model, self.plan)
        except Exception as e:  # noqa: BLE001 - every rank learns it below
            error, tensors, modules = e, {}, []
        if rdist.rank() == 0 and error is None:
            try:
                sent = self._send_adapter(f"{self.name}-v{self.version}", tensors, modules)
            except Exception as e:  # noqa: BLE001 - every rank learns it below
                error = e
        failed = any_rank(error is not None)
        self.errors = []
        if failed:
            self.engines_restarted()
            texts = _gather_to_rank0(f"rank 0: {type(error).__name__}: {error}" if error else None)
            self.errors = [t for t in texts if t] if rdist.rank() == 0 else []
        else:
            self.base_on_engines = True
        sent_bytes = float(rdist.broadcast_object(sent) if rdist.world_size() > 1 else sent)
        total = base_bytes + sent_bytes
        metrics.update(
            {
                "sync/total_s": time.perf_counter() - t0,
                "sync/version": float(self.version),
                "sync/bytes": total if rdist.rank() == 0 else metrics.get("sync/bytes", 0.0),
                "sync/bytes_total": total,
                "sync/adapter_bytes": sent_bytes,
                "sync/base_bytes": base_bytes,
                "sync/lora_adapter_bytes": float(self.lora_bytes),
            }
        )
        metrics.setdefault("sync/bytes_max_rank", total)
        return metrics

    def _write_peft_dir(self, name: str, tensors: dict, config: dict) -> str:
        """``<adapter_dir>/<name>`` (``models.lora_peft.save_peft_dir``), written to a temporary name
        and renamed, so an engine never reads a partial directory. Returns its absolute path."""
        import shutil

        from gspo_megatron.models.lora_peft import save_peft_dir

        assert self.adapter_dir is not None
        final = os.path.abspath(os.path.join(self.adapter_dir, name))
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        save_peft_dir(tmp, tensors, config)
        os.replace(tmp, final)
        return final

    def _send_adapter(self, name: str, tensors: dict, modules: list[str]) -> int:
        """Rank 0: load adapter ``name`` (``tensors``: the gathered PEFT tensors) on every engine,
        unload the previous one, set the weight version; the rollout engine's requests name ``name``
        after. Returns the bytes of one copy."""
        from gspo_megatron.engines.sglang_client import SGLangError
        from gspo_megatron.models.lora_peft import peft_config

        gpt = unwrap_gpt(self.model)
        tensors, modules = fuse_shared_a(tensors, modules)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        config = peft_config(gpt.lora, modules, None)
        path = payload = None
        if self.adapter_dir is not None:  # engines on other hosts: sglang's /load_lora_adapter reads the directory
            path = self._write_peft_dir(name, tensors, config)
        else:  # by value: TP ranks on any node decode it
            payload = by_value_payload(tensors)
        for client in self.engine.clients:
            body: dict[str, Any]
            if path is not None:
                route, body = "load_lora_adapter", {"lora_name": name, "lora_path": path}
            else:
                route, body = (  # one item per engine TP rank (tp_worker.py deserialize_own_rank)
                    "load_lora_adapter_from_tensors",
                    {
                        "lora_name": name,
                        "config_dict": config,
                        "serialized_named_tensors": [payload] * int(client.tp_size),
                    },
                )
            out = client.post(route, body)
            if not (isinstance(out, dict) and out.get("success")):
                raise SGLangError(f"{client}.{route}({name}) failed: {out}")
            if self.current is not None and self.current != name:
                try:
                    client.post("unload_lora_adapter", {"lora_name": self.current})
                except SGLangError as e:  # a restarted engine never had it
                    if "does not exist" not in str(e):
                        raise
            client.post("update_weight_version", {"new_version": str(self.version)})
        previous, self.current = self.current, name
        self.engine.lora_path = name
        if self.adapter_dir is not None and previous is not None and previous != name:
            import shutil

            shutil.rmtree(os.path.join(self.adapter_dir, previous), ignore_errors=True)  # unloaded everywhere
        return sum(t.numel() * t.element_size() for t in tensors.values())
