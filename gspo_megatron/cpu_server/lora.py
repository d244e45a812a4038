"""LoRA adapters on the CPU server: sglang 0.5.23's dynamic adapter routes and per-request ``lora_path``.

Routes (``srt/entrypoints/http_server.py``: 200 with the result, 400 when ``success`` is false):
``POST /load_lora_adapter_from_tensors`` (``LoadLoRAAdapterFromTensorsReqInput``: ``lora_name``,
``config_dict``, ``serialized_named_tensors`` (one base64 ``MultiprocessingSerializer`` payload per TP
rank), ``pinned``, ``added_tokens_config``, ``load_format`` (None or ``flattened_bucket``),
``expected_checksums``), ``POST /load_lora_adapter`` (``LoadLoRAAdapterReqInput``: ``lora_name``,
``lora_path``: a local PEFT directory, ``adapter_config.json`` + ``*.safetensors``, as sglang's
``LoRAConfig`` / ``LoRAAdapter.initialize_weights`` read it; ``pinned``) and ``POST
/unload_lora_adapter`` (``UnloadLoRAAdapterReqInput``: ``lora_name``); all answer ``LoRAUpdateOutput``
``{success, error_message, loaded_adapters}`` (``loaded_adapters``: name -> its ``lora_path``,
``"__tensor__"`` for tensors).

What runs sglang's own code (imported from sglang, never copied): ``LoRAConfig.from_dict`` (the PEFT
config: ``r``, ``lora_alpha``, ``target_modules``, ``use_dora``, added tokens filtered against the base
vocabulary), ``LoRAAdapter.initialize_weights_from_tensors`` (``srt/lora/lora.py``: ``_process_weight``
by layer id, ``normalize_qkv_proj`` / ``normalize_gate_up_proj`` / ``normalize_fused_qkv_a_proj``:
q/k/v stacked into ``qkv_proj`` with A ``[3r, in]`` and B ``[q + k + v, r]``, a fused A repeated),
``get_normalized_target_modules`` (``srt/lora/utils.py``), ``MultiprocessingSerializer`` and
``FlattenedTensorBucket`` (the payload decode, as ``managers/tp_worker.py``
``load_lora_adapter_from_tensors``), and ``SUPPORTED_LORA_TARGET_MODULES`` (the flag's choices).

Stand-ins (sglang's logic re-stated where its code needs the GPU scheduler / memory pool; each cites
its source):
- the refusals, same texts and order: ``managers/tokenizer_control_mixin.py``
  ``load_lora_adapter_from_tensors`` / ``unload_lora_adapter`` (not enabled; ``dp_size == 1``
  asserted, an uncaught AssertionError there, a 500 here; the registry's ``unregister``:
  ``lora/lora_registry.py``), ``lora/lora_manager.py`` ``validate_new_adapter`` (added tokens, DoRA,
  already loaded, and ``mem_pool.py`` ``can_support``: rank over ``--max-lora-rank``, a target outside
  ``--lora-target-modules``), ``lora/lora.py`` ``LoRAAdapter.__init__``'s ``peft_type`` assertion;
  ``--max-loaded-loras``: the least recently used unpinned adapter is unloaded after a load
  (tokenizer_control_mixin.py);
- generation (``managers/tokenizer_manager.py`` ``_validate_and_resolve_lora``): ``lora_path`` without
  ``--enable-lora`` is refused; an unknown name is refused ("never been loaded"); a name loaded from
  tensors and unloaded since is refused too (sglang tries to reload it from its ``lora_path``
  ``"__tensor__"``, which fails);
- the computation: sglang runs ``x W + s (x A) B`` unmerged on its stacked buffers (each q/k/v and
  gate/up slice with its own ``r`` rows of A); here rank 0 runs its transformers model with the
  adapter merged for the requests that name it, ``W + s B_i A_i`` per slice in fp32 and cast to the
  model dtype (the trainer's own ``models/lora.py`` ``merge``), so that fp32 CPU serving equals the
  trainer's merged model exactly; the base is restored after. TP: every rank decodes and processes
  its own payload (sglang's ranks then slice it: ``slice_lora_a_weights`` / ``slice_lora_b_weights``);
  rank 0 applies the whole adapter to its assembled model. Routed experts: per-expert adapters
  (``...mlp.experts.<e>.{gate,up,down}_proj``, sglang's per-expert form) are applied to that expert's slice of
  transformers' fused 3-D expert parameters (``_expert_views``); shared-outer 3-D adapters and embedding / lm_head
  adapters are refused by this stand-in (not by sglang). As sglang, expert adapters are dropped unless the
  server's targets hold both ``gate_up_proj`` and ``down_proj`` (``lora_manager.py`` ``init_lora_modules``
  wraps a ``FusedMoE`` only then);
- nodes: a payload's shared-memory segment opens only on its creator's host (``hosts.segments_of_host``;
  ``hosts.simulated_host`` tells simulated nodes on one machine apart), as on sglang's TP ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from typing import Any, Iterator

import torch

from gspo_megatron.cpu_server.hosts import segments_of_host, simulated_host

TENSOR_PATH = "__tensor__"  # LoadLoRAAdapterFromTensorsReqInput.to_ref's lora_path
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
DP_REFUSAL = "data-parallel replicas are not supported for dynamic lora loading"


def supported_target_modules() -> list[str]:
    """sglang's ``--lora-target-modules`` choices (``srt/utils/common.py``) plus ``all``."""
    try:
        from gspo_megatron.cpu_server.sglang_models import install_import_stubs

        install_import_stubs()
        from sglang.srt.utils.common import LORA_TARGET_ALL_MODULES, SUPPORTED_LORA_TARGET_MODULES

        return list(SUPPORTED_LORA_TARGET_MODULES) + [LORA_TARGET_ALL_MODULES]
    except Exception:  # noqa: BLE001 - sglang absent: the 0.5.23 list
        return (
            "q_proj k_proj v_proj o_proj q_a_proj kv_a_proj_with_mqa q_b_proj kv_b_proj wq_b wk weights_proj "
            "gate_proj up_proj down_proj qkv_proj gate_up_proj embed_tokens lm_head qkvr wo_ud all"
        ).split()


def add_lora_args(p) -> None:
    """sglang's LoRA flags (``srt/arg_groups/fields/lora.py``) the project passes, plus ``--dp-size``."""
    p.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="dynamic LoRA adapters (/load_lora_adapter_from_tensors, /unload_lora_adapter, lora_path)",
    )
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None, choices=supported_target_modules())
    p.add_argument("--max-loaded-loras", type=int, default=None)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument(
        "--dp-size",
        "--data-parallel-size",
        dest="dp_size",
        type=int,
        default=1,
        help="accepted and recorded (the CPU server runs one replica); refuses dynamic LoRA loading "
        "when > 1, as sglang",
    )


def check_lora_args(p, ns) -> None:
    """``srt/arg_groups/lora_hook.py`` ``check_lora_server_args`` (no --lora-paths here): its
    assertions as argparse errors."""
    if ns.max_loras_per_batch <= 0:
        p.error("max_loras_per_batch must be positive")
    if not ns.enable_lora:
        return
    if ns.lora_target_modules and "all" in ns.lora_target_modules and len(ns.lora_target_modules) != 1:
        p.error("If 'all' is specified in --lora-target-modules, it should be the only module specified.")
    if not (ns.max_lora_rank and ns.lora_target_modules):
        p.error(
            "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
            "--lora-target-modules for LoRA initialization."
        )
    if ns.max_loaded_loras is not None and ns.max_loaded_loras < ns.max_loras_per_batch:
        p.error(
            "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
            f"max_loaded_loras={ns.max_loaded_loras}, max_loras_per_batch={ns.max_loras_per_batch}"
        )


def _sglang():
    from gspo_megatron.cpu_server.sglang_models import install_import_stubs

    install_import_stubs()
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.lora.utils import get_normalized_target_modules

    return LoRAAdapter, LoRAConfig, get_normalized_target_modules


def update_output(success: bool, error_message: str | None, loaded: dict | None) -> dict:
    """``LoRAUpdateOutput`` as sglang's route returns it (``msgspec_to_builtins``)."""
    return {"success": success, "error_message": error_message, "loaded_adapters": loaded}


# -- the TP ranks ---------------------------------------------------------------------------------
class WorkerLoras:
    """One TP rank's adapters (``lora_manager.py``'s ``configs`` / ``loras`` / ``lora_refs``)."""

    def __init__(self, args, hf_config) -> None:
        import os

        self.args, self.hf_config = args, hf_config
        self.adapters: dict[str, dict] = {}  # name -> {"scaling", "pinned", "weights": {name: tensor}}
        self.host = simulated_host(os.getpid()) or ""  # now, while the process that launched the server lives

    def loaded(self) -> dict[str, str]:
        return {n: a.get("path", TENSOR_PATH) for n, a in self.adapters.items()}

    def _result(self, ok: bool, msg: str = "") -> dict:
        return {"success": ok, "message": msg, "lora": update_output(ok, msg, self.loaded())}

    def _server_targets(self, normalize) -> set[str] | None:
        t = self.args.lora_target_modules or []
        return None if "all" in t else normalize(t)

    def load(
        self,
        tp_rank: int,
        lora_name: str,
        config_dict: dict,
        serialized_named_tensors: list,
        pinned: bool = False,
        added_tokens_config: dict | None = None,
        load_format: str | None = None,
        expected_checksums: dict | None = None,
    ) -> dict:
        from gspo_megatron.engines.sglang_compat import (
            multiprocessing_serializer,
            require_flattened_bucket_class,
            use_cpu_shared_memory,
        )

        try:
            _sglang()  # the import stubs (sglang's serializer modules)
            # managers/tp_worker.py load_lora_adapter_from_tensors: this rank's payload
            if tp_rank >= len(serialized_named_tensors):
                raise IndexError(
                    f"serialized_named_tensors has {len(serialized_named_tensors)} payload(s); TP rank "
                    f"{tp_rank} reads item {tp_rank} (one per TP rank)"
                )
            use_cpu_shared_memory()
            with segments_of_host(self.host):  # a shared-memory segment opens on its own host only
                data = multiprocessing_serializer().deserialize(serialized_named_tensors[tp_rank])
            if load_format == "flattened_bucket":
                tensors = dict(
                    require_flattened_bucket_class()(
                        flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
                    ).reconstruct_tensors()
                )
            else:
                tensors = dict(data)
            tensors = {k: v.detach().cpu().clone() for k, v in tensors.items()}  # off the shared segments
            if expected_checksums is not None:
                _check_sums(tp_rank, tensors, expected_checksums)
        except Exception as e:  # noqa: BLE001 - sglang's scheduler would raise; answer instead
            return self._result(False, f"{type(e).__name__}: {e}")
        return self._register(lora_name, config_dict, tensors, pinned, added_tokens_config, TENSOR_PATH)

    def load_from_path(self, tp_rank: int, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """``/load_lora_adapter``: a PEFT directory (``lora_manager.py`` ``load_lora_adapter``:
        ``LoRAConfig(path)`` reads ``adapter_config.json`` and ``added_tokens.json``;
        ``LoRAAdapter.initialize_weights`` the directory's ``*.safetensors`` (``*.bin`` when none)). A
        path that is not a local directory is refused (sglang would download it from the Hub)."""
        import glob
        import json
        import os

        try:
            if not os.path.isdir(lora_path):
                raise FileNotFoundError(
                    f"the CPU server loads LoRA adapters from a local directory; {lora_path!r} is "
                    "not one (on another host the directory must be on a shared filesystem)"
                )
            with open(os.path.join(lora_path, "adapter_config.json")) as f:
                config_dict = json.load(f)
            added = None
            if os.path.exists(os.path.join(lora_path, "added_tokens.json")):
                with open(os.path.join(lora_path, "added_tokens.json")) as f:
                    added = json.load(f)
            tensors: dict = {}
            files = sorted(glob.glob(os.path.join(lora_path, "*.safetensors")))
            if files:
                from safetensors.torch import load_file

                for fn in files:
                    tensors.update(load_file(fn))
            else:
                for fn in sorted(glob.glob(os.path.join(lora_path, "*.bin"))):
                    tensors.update(torch.load(fn, map_location="cpu", weights_only=True))
        except Exception as e:  # noqa: BLE001 - lora_manager returns the error text
            return self._result(False, f"{type(e).__name__}: {e}")
        return self._register(lora_name, config_dict, tensors, pinned, added, lora_path)

    def _register(
        self,
        lora_name: str,
        config_dict: dict,
        tensors: dict,
        pinned: bool,
        added_tokens_config: dict | None,
        path: str,
    ) -> dict:
        LoRAAdapter, LoRAConfig, normalize = _sglang()
        try:  # lora_manager.py _load_lora_adapter_from_tensors / load_lora_adapter
            config = LoRAConfig.from_dict(config_dict, added_tokens_config, base_vocab_size=self.hf_config.vocab_size)
            # validate_new_adapter
            if config.lora_added_tokens_size > 0:
                raise ValueError(
                    f"Failed to load {lora_name} because LoRA serving currently doesn't support adapters "
                    "that add tokens to the vocabulary"
                )
            if config.use_dora:
                raise ValueError(
                    f"Failed to load {lora_name} because LoRA serving currently doesn't support DoRA adapters"
                )
            if lora_name in self.adapters:
                raise ValueError(f"Failed to load LoRA adapter {lora_name} because it is already loaded")
            server = self._server_targets(normalize)
            wanted = normalize(config.target_modules)
            if config.r > (self.args.max_lora_rank or 0) or (
                server is not None and "all" not in wanted and not wanted.issubset(server)
            ):
                raise ValueError(
                    f"LoRA adapter {lora_name} with rank {config.r} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
                )
            pinned_now = sum(a["pinned"] for a in self.adapters.values())
            if pinned and pinned_now >= self.args.max_loras_per_batch - 1:
                raise ValueError(
                    f"Failed to load LoRA adapter {lora_name} as a pinned adapter. It is not allowed to pin all slots "
                    "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
                    "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters."
                )
            if str(config.hf_config.get("peft_type", "")).lower() != "lora":  # LoRAAdapter.__init__'s assert
                raise AssertionError("")
            adapter = LoRAAdapter(lora_name, config, self.hf_config, None, None, None)
            adapter.initialize_weights_from_tensors(tensors)
            weights: dict[str, torch.Tensor] = {}
            for layer in adapter.layers:
                weights.update(layer.weights)
            if server is not None and not {"gate_up_proj", "down_proj"} <= server:
                # lora_manager.py init_lora_modules: a FusedMoE is wrapped with LoRA only when both are
                # targets; unwrapped, the memory pool never reads its experts' adapters (dropped silently)
                weights = {n: w for n, w in weights.items() if not re.search(r"\.experts\.", n)}
            if adapter.embedding_layers or adapter.added_tokens_embeddings:
                raise ValueError(
                    f"the CPU server does not apply embedding / lm_head adapters "
                    f"({sorted(adapter.embedding_layers) + sorted(adapter.added_tokens_embeddings)})"
                )
            shared_outer = [
                n for n in weights if re.search(r"\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)\.", n)
            ]
            if shared_outer:
                raise ValueError(
                    f"the CPU server applies per-expert routed-expert adapters "
                    f"(...experts.<e>.<module>.lora_A/B.weight), not shared-outer 3-D ones ({shared_outer[:3]})"
                )
            self.adapters[lora_name] = {
                "scaling": float(adapter.scaling),
                "pinned": bool(pinned),
                "weights": weights,
                "path": path,
            }
        except Exception as e:  # noqa: BLE001 - lora_manager returns the error text
            return self._result(False, str(e))
        return self._result(True)

    def unload(self, lora_name: str) -> dict:
        self.adapters.pop(lora_name, None)  # lora_manager._unload_lora_adapter: pops whatever is there
        return self._result(True)

    # -- rank 0: serving ------------------------------------------------------------------------
    def deltas(self, name: str, model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(weight of ``model``, A_i, B_i) per HF linear the adapter ``name`` touches: sglang's
        stacked ``qkv_proj`` / ``gate_up_proj`` split back into their slices (slice i uses A's rows
        ``[i r, (i + 1) r)`` and B's rows of module i). A routed expert's ``...experts.<e>.gate_proj`` /
        ``up_proj`` / ``down_proj`` is that expert's slice of transformers' fused 3-D parameters when
        the model has no per-expert linear (``Qwen3MoeExperts``: ``gate_up_proj`` [E, 2I, H], gate rows
        then up rows; ``down_proj`` [E, H, I])."""
        from gspo_megatron.models.lora_peft import PEFT_PREFIX, SGLANG_FUSED

        params = dict(_expert_views(model))
        params.update(model.named_parameters())
        ad = self.adapters[name]
        out = []
        for key, a in ad["weights"].items():
            if ".lora_A." not in key:
                continue
            b = ad["weights"][key.replace(".lora_A.", ".lora_B.")]
            module = key.split(".lora_A.")[0]
            module = module.removeprefix(PEFT_PREFIX)
            leaf = module.rsplit(".", 1)[-1]
            if leaf in SGLANG_FUSED:
                names = [module[: -len(leaf)] + p + ".weight" for p in SGLANG_FUSED[leaf]]
                r = a.shape[0] // len(names)
                row = 0
                for i, n in enumerate(names):
                    if n not in params:
                        raise KeyError(f"adapter {name}: {key} -> {n}, which the model does not have")
                    out_i = params[n].shape[0]
                    out.append((params[n], a[i * r : (i + 1) * r], b[row : row + out_i]))
                    row += out_i
            else:
                n = module + ".weight"
                if n not in params:
                    raise KeyError(f"adapter {name}: {key} -> {n}, which the model does not have")
                out.append((params[n], a, b))
        return out

    @contextlib.contextmanager
    def applied(self, name: str | None, model: torch.nn.Module) -> Iterator[None]:
        """``model`` serves ``W + s B A`` of adapter ``name`` inside (the base outside; None: the base)."""
        if name is None:
            yield
            return
        from gspo_megatron.models.lora import merge  # the trainer's merge, bit for bit

        s = self.adapters[name]["scaling"]
        saved = []
        with torch.no_grad():
            for p, a, b in self.deltas(name, model):
                saved.append((p, p.data.clone()))
                p.data.copy_(merge(p.data, a, b, s))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, base in reversed(saved):
                    p.data.copy_(base)


def _expert_views(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert HF weight names (``...experts.<e>.{gate,up,down}_proj.weight``) -> views of
    transformers' fused expert parameters (``...experts.gate_up_proj`` [E, 2I, H]: gate rows first,
    as its forward's ``chunk(2, dim=-1)``; ``...experts.down_proj`` [E, H, I])."""
    for n, p in model.named_parameters():
        if n.endswith(".experts.gate_up_proj") and p.dim() == 3:
            prefix, half = n[: -len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", p.data[e, :half]
                yield f"{prefix}{e}.up_proj.weight", p.data[e, half:]
        elif n.endswith(".experts.down_proj") and p.dim() == 3:
            prefix = n[: -len("down_proj")]
            for e in range(p.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", p.data[e]


def _check_sums(tp_rank: int, tensors: dict, exp: dict) -> None:
    """``managers/tp_worker.py``'s ``expected_checksums`` check (sha256 of each tensor's bytes)."""
    mismatch, missing = [], []
    for name, want in exp.items():
        if name not in tensors:
            missing.append(name)
            continue
        got = hashlib.sha256(
            tensors[name].detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        if got != want:
            mismatch.append(name)
    extra = [n for n in tensors if n not in exp]
    if mismatch or missing or extra:
        raise RuntimeError(
            f"[LORA-CHECK] rank{tp_rank} adapter sync MISMATCH of {len(exp)} expected: "
            f"{len(mismatch)} value-diff {mismatch[:5]}, {len(missing)} missing {missing[:5]}, "
            f"{len(extra)} extra {extra[:5]}"
        )


# -- the HTTP front (sglang's tokenizer manager) ------------------------------------------------------
class FrontLoras:
    """The tokenizer manager's side: the registry of names (with LRU order and pins), the names ever
    loaded (``lora_ref_cache``), the refusals before the ranks, and ``lora_path`` resolution."""

    def __init__(self, args) -> None:
        self.args = args
        self.registry: dict[str, dict] = {}  # name -> {"pinned", "used"}
        self.ever: list[str] = []
        self.paths: dict[str, str] = {}  # name -> the lora_path it was last loaded from

    def _front_refusal(self) -> tuple[int, Any] | None:
        if not self.args.enable_lora:
            return 400, update_output(False, NOT_ENABLED, None)
        if getattr(self.args, "dp_size", 1) != 1:  # an AssertionError sglang does not catch: HTTP 500
            return 500, {"error": {"message": DP_REFUSAL}}
        return None

    def load(self, body: dict, command) -> tuple[int, Any]:
        refused = self._front_refusal()
        if refused is not None:
            return refused
        name = body["lora_name"]
        payloads = body["serialized_named_tensors"]
        payloads = [payloads] if isinstance(payloads, (str, bytes)) else list(payloads)
        result = command(
            "lora_load",
            lora_name=name,
            config_dict=body["config_dict"],
            serialized_named_tensors=payloads,
            pinned=bool(body.get("pinned", False)),
            added_tokens_config=body.get("added_tokens_config"),
            load_format=body.get("load_format"),
            expected_checksums=body.get("expected_checksums"),
        )
        return self._registered(name, body, result, command)

    def load_path(self, body: dict, command) -> tuple[int, Any]:
        """``POST /load_lora_adapter`` (``LoadLoRAAdapterReqInput``: ``lora_name``, ``lora_path``,
        ``pinned``): every rank reads the PEFT directory (``WorkerLoras.load_from_path``)."""
        refused = self._front_refusal()
        if refused is not None:
            return refused
        name = body["lora_name"]
        result = command(
            "lora_load_path", lora_name=name, lora_path=str(body["lora_path"]), pinned=bool(body.get("pinned", False))
        )
        return self._registered(name, body, result, command)

    def _registered(self, name: str, body: dict, result: dict, command) -> tuple[int, Any]:
        out = _merged(result)
        if out["success"]:
            self.registry[name] = {"pinned": bool(body.get("pinned", False)), "used": time.monotonic()}
            if name not in self.ever:
                self.ever.append(name)
            self.paths[name] = str(body.get("lora_path") or TENSOR_PATH)
            limit = self.args.max_loaded_loras
            while limit is not None and len(self.registry) > limit:  # evict the least recently used
                unpinned = [(v["used"], k) for k, v in self.registry.items() if not v["pinned"]]
                if not unpinned:
                    return 400, update_output(
                        False,
                        "Didn't find any LoRA adapters when trying to evict LRU LoRA "
                        f"adapter. LoRA registry is: {self.registry}",
                        None,
                    )
                victim = min(unpinned)[1]
                self.registry.pop(victim)
                unloaded = _merged(command("lora_unload", lora_name=victim))
                if not unloaded["success"]:
                    return 400, update_output(
                        False, f"Error while unloading LRU LoRA adapter '{victim}': {unloaded['error_message']}", None
                    )
                out["loaded_adapters"].pop(victim, None)
        return (200 if out["success"] else 400), out

    def unload(self, body: dict, command) -> tuple[int, Any]:
        if not self.args.enable_lora:
            return 400, update_output(False, NOT_ENABLED, None)
        name = body["lora_name"]
        if name is None:
            return 500, {"error": {"message": "lora_name must be provided to unload LoRA adapter"}}
        if getattr(self.args, "dp_size", 1) != 1:
            return 500, {"error": {"message": DP_REFUSAL}}
        if name not in self.registry:  # lora_registry.py unregister
            return 400, update_output(
                False, f"LoRA with name {name} does not exist. Loaded LoRAs: {self.registry.keys()}", None
            )
        self.registry.pop(name)
        out = _merged(command("lora_unload", lora_name=name))
        return (200 if out["success"] else 400), out

    def resolve(self, lora_paths: list) -> str | None:
        """None when the generation may run, else sglang's refusal (``_validate_and_resolve_lora``)."""
        if not any(lora_paths):
            return None
        if not self.args.enable_lora:
            first = next(a for a in lora_paths if a)
            return (
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        unique = set(lora_paths)
        if self.args.max_loaded_loras is not None and len(unique) > self.args.max_loaded_loras:
            return (
                f"Received request with {len(unique)} unique loras requested but max loaded loras is "
                f"{self.args.max_loaded_loras}"
            )
        for name in unique:
            if name is None or name in self.registry:
                continue
            if name not in self.ever:
                return (
                    f"Got LoRA adapter that has never been loaded: {name}\n"
                    f"All loaded adapters: {dict.fromkeys(self.ever).keys()}."
                )
            if self.paths.get(name, TENSOR_PATH) != TENSOR_PATH:  # sglang would reload it from its path
                return (
                    f"LoRA adapter {name} was unloaded; the CPU server does not reload adapters implicitly "
                    f"(sglang would, from {self.paths[name]!r}): load it again with /load_lora_adapter"
                )
            return (
                f"Failed to implicitly load LoRA adapter {name}: it was loaded from tensors "
                f"(lora_path {TENSOR_PATH!r}) and unloaded since; sglang cannot reload it from a path"
            )
        now = time.monotonic()
        for name in unique:
            if name is not None:
                self.registry[name]["used"] = now
        return None


def _merged(result: dict) -> dict:
    """The ranks' ``LoRAUpdateOutput`` merged (``tokenizer_control_mixin.py``
    ``_merge_lora_update_results``: failures win, their messages joined)."""
    ranks = [
        r.get("lora") or update_output(bool(r.get("success")), r.get("message"), None)
        for r in result.get("ranks", [result])
    ]
    failed = [r for r in ranks if not r["success"]]
    if not failed:
        return dict(ranks[0])
    msgs = list(dict.fromkeys(r["error_message"] for r in failed if r["error_message"]))
    return update_output(False, " | ".join(msgs), failed[0]["loaded_adapters"])


def lora_paths_of(body: dict, n: int) -> list:
    """``GenerateReqInput.lora_path`` per input: a string (or None) for all, or a list of n."""
    lp = body.get("lora_path")
    if isinstance(lp, list):
        if len(lp) != n:
            raise ValueError(f"{len(lp)} lora_path entries for {n} inputs")
        return list(lp)
    return [lp] * n
