"""sglang 0.5.23's own model classes on CPU, for loading weight-sync buckets with sglang's real loaders.

The CPU server (and tests) hold, on each engine TP rank, the model class sglang would serve the
checkpoint with, built the way sglang's model runner builds it, and hand every received bucket to
its ``load_weights`` exactly as sglang's weight updater does: one call per
``update_weights_from_tensor`` / ``update_weights_from_distributed`` bucket
(``srt/model_executor/model_runner_components/weight_updater.py``: ``update_weights_from_tensor``,
``_update_weights_from_flattened_bucket`` and ``load_weights_from_distributed`` each call
``self.get_model().load_weights(named_tensors)`` once with the bucket's list). Only kernel forwards
are GPU-only; the classes' constructors and loaders run on CPU. Nothing here generates.

Pieces and the sglang source each follows:
- :func:`install_import_stubs`: ``sgl_kernel`` (CUDA kernels) and ``torchvision`` (imported by
  ``srt/configs/__init__.py``'s multimodal configs) are not installable on this CPU machine; any
  import of them gets a permissive stub module. transformers' cached ``is_torchvision_available``
  is evaluated first, so transformers (the CPU server's generation) still sees no torchvision.
  ``SGLANG_USE_CPU_ENGINE=1`` selects sglang's CPU platform (``srt/utils/common.py`` ``is_cpu``).
- :func:`init_parallel`: ``srt/managers/scheduler.py`` ``run_scheduler_process`` (``publish`` of the
  server args with the rank's ``SpawnRanks``) and ``srt/model_executor/model_runner.py``
  ``init_torch_distributed`` (``init_distributed_environment`` + ``initialize_model_parallel``),
  on gloo over this process's existing torch.distributed world (the engine's TP ranks).
- :func:`gpu_capability_stand_in`: the one GPU probe a DSA model (DeepSeek-V3.2, GLM-5) meets while
  sglang resolves its server args. On the CPU platform (neither NPU nor XPU) sglang takes the CUDA/ROCm
  branch and calls ``torch.cuda.get_device_capability()`` (``srt/arg_groups/model_hook.py`` line 341,
  ``handle_model_specific_adjustments``: the result unused; ``srt/arg_groups/overrides.py`` line 512,
  ``_dsa_kv_cache_dtype_default``: kv_cache_dtype bfloat16 below SM100; line 631,
  ``_dsa_split_backend_resolution``: the DSA attention kernels), which raises without CUDA. Answered
  (9, 0), the SM90 of the H100/H200 engines, only while no CUDA device exists. Those choices concern
  the KV cache and kernels, not a parameter: names, shapes and fusing come from the platform
  (``srt/layers/attention/dsa/dsa_indexer.py`` line 310: ``wk`` + ``weights_proj`` fused into
  ``wk_weights_proj`` only on CUDA; the CPU build keeps sglang's own CPU layout, both loaded from the
  checkpoint names ``indexer.wk`` / ``indexer.weights_proj``).
- :class:`SglangModel`: ``srt/model_loader/loader.py`` ``DefaultModelLoader.load_model`` (the
  class built under ``set_default_torch_dtype(model_config.dtype)`` on the target device, here
  ``cpu``) and ``_initialize_model`` (``resolve_shared_experts_config`` + the class constructor),
  except that the class is imported from its own module (``srt/models/<module>.py``, whose
  ``EntryClass`` sglang's registry reads; the family's ``sglang_modules``, :data:`MODULES`) instead of
  through ``srt/models/registry.py``, which imports every model module (about 4 s a rank); an
  architecture of no registered family goes through the registry.
  ``load`` is the weight updater's call; ``process_weights_after_loading`` (AMX repacking on CPU, a
  no-op for unquantized weights on GPU) is not run.
- The written check (not sglang's: ours, so that a partial load cannot pass silently): before a full
  sync every parameter is filled with NaN (:meth:`SglangModel.poison`); after it, a parameter with a
  NaN left was not (completely) written by sglang's loader (:meth:`SglangModel.unwritten`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from typing import Any, Iterable

import torch

from gspo_megatron.models.hf_config import architecture_of
from gspo_megatron.models.registry import families
from gspo_megatron.runtime.scoped_attrs import module_attrs

SGLANG_VERSION = "0.5.23"
STUBBED = ("sgl_kernel", "torchvision")

# architecture -> sglang module (srt/models/<module>.py defines it in EntryClass): each registered family's
# ``sglang_modules`` (``models/family.py``); an architecture of no family goes through sglang's registry
MODULES: dict[str, str] = {arch: module for f in families() for arch, module in f.sglang_modules.items()}
# the same for the speculative draft classes sglang builds for an MTP checkpoint (``ModelConfig(is_draft_model=
# True)`` renames the architecture, e.g. to ``...ForCausalLMNextN``): each family's ``sglang_draft_modules``
DRAFT_MODULES: dict[str, str] = {arch: module for f in families() for arch, module in f.sglang_draft_modules.items()}


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _Any(metaclass=_AnyMeta):
    """Whatever a stubbed module's attribute is asked to be: callable, subclassable, any attribute."""

    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Any()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Any,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves a stub module for ``sgl_kernel[.*]`` and ``torchvision[.*]`` (only when not installed)."""

    def __init__(self, roots):
        self.roots = tuple(roots)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def install_import_stubs() -> None:
    """Idempotent: CPU platform env and the stubs for whichever of ``STUBBED`` is not installed."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cached before the stub exists: transformers sees none
    import_utils.is_torchvision_v2_available()
    missing = [m for m in STUBBED if m not in sys.modules and importlib.util.find_spec(m) is None]
    if missing:
        sys.meta_path.insert(0, _StubFinder(missing))
    if "sgl_kernel" in missing and not isinstance(torch.ops.sgl_kernel, _KernelOps):
        setattr(torch.ops, "sgl_kernel", _KernelOps(torch.ops.sgl_kernel))  # torch.ops: a namespace of attributes


# ``torch.ops.sgl_kernel`` ops that sglang's modules bind at import on the CPU platform (``srt/models/qwen3_5.py``
# lines 283-298, imported by ``qwen3_5_text.py``): without sgl_kernel the lookup raises, the import fails and
# sglang's registry (which skips modules that fail to import) reports "Qwen3_5MoeForCausalLM has no SGlang
# implementation". Bound to a stand-in that raises when called (the twin never runs a forward).
IMPORT_BOUND_KERNELS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)


class _KernelOps:
    """``torch.ops.sgl_kernel`` without sgl_kernel: the real (empty) op namespace, except that the
    :data:`IMPORT_BOUND_KERNELS` resolve (``hasattr`` of any other op stays False: sglang probes
    ``convert_weight_packed`` / ``fused_qk_norm_cpu`` that way to choose its CPU paths)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        if name in IMPORT_BOUND_KERNELS:

            def missing(*args, **kwargs):
                raise RuntimeError(f"torch.ops.sgl_kernel.{name} is not available: sgl_kernel is not installed")

            return missing
        return getattr(self._real, name)


def import_error() -> str | None:
    """None when sglang's model code imports here; else one line saying why not."""
    try:
        install_import_stubs()
        import sglang
        from sglang.srt.distributed import initialize_model_parallel  # noqa: F401
        from sglang.srt.model_loader.loader import _initialize_model  # noqa: F401
        from sglang.srt.runtime_context import publish  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError and whatever an import chain raises
        return (
            f"sglang's model classes do not import ({type(e).__name__}: {e}); install sglang=={SGLANG_VERSION} "
            "with --no-deps and the `sglang-cpu` extra (see the Makefile)"
        )
    if getattr(sglang, "__version__", SGLANG_VERSION) != SGLANG_VERSION:
        return f"sglang {sglang.__version__} is installed; the CPU server follows sglang {SGLANG_VERSION}"
    return None


def server_args(
    model_path: str,
    tp_size: int,
    ep_size: int = 1,
    dtype: str = "auto",
    init_expert_location: str = "trivial",
    custom_weight_loader: list[str] | None = None,
):
    """sglang's ``ServerArgs`` for this engine on CPU (no tokenizer; weights come by load);
    ``init_expert_location``: sglang's ``--init-expert-location`` (EPLB's initial placement);
    ``custom_weight_loader``: ``--custom-weight-loader`` (read by sglang's ``WeightUpdater``)."""
    install_import_stubs()
    from sglang.srt.server_args import ServerArgs

    extra: dict[str, Any] = {}
    if architecture_of(model_path) in LINEAR_ATTENTION_HYBRIDS:
        # sglang's "auto" picks the extra_buffer Mamba-state cache, which only GPU platforms support
        # (arg_groups/mamba_hook.py validate_mamba_extra_buffer); no_buffer needs no overlap schedule
        extra.update(mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True)
    return ServerArgs(
        model_path=model_path,
        device="cpu",
        tp_size=tp_size,
        ep_size=ep_size,
        dtype=dtype,
        load_format="dummy",
        skip_tokenizer_init=True,
        init_expert_location=init_expert_location,
        custom_weight_loader=list(custom_weight_loader or []),
        **extra,
    )


# architecture -> prefixes of sglang parameters the weight sync never sends (carried tensors of the checkpoint,
# ``models/carried.py``: a vision tower the engine keeps from start-up): neither poisoned nor checked
# (each family's ``sglang_kept_from_start``)
KEPT_FROM_START: dict[str, tuple[str, ...]] = {
    arch: kept for f in families() for arch, kept in f.sglang_kept_from_start.items()
}

# architectures with Gated DeltaNet layers, whose sglang classes keep a Mamba-style state cache (the families
# with ``sglang_mamba_cache``)
LINEAR_ATTENTION_HYBRIDS: tuple[str, ...] = tuple(
    arch for f in families() if f.sglang_mamba_cache for arch in f.architectures
)


_PARALLEL: tuple | None = None  # (tp_size, ep_size) of the groups built in this process


GPU_CAPABILITY = (9, 0)  # H100 / H200 (SM90): what gpu_capability_stand_in answers on a machine without CUDA


@contextlib.contextmanager
def gpu_capability_stand_in():
    """While active and only without a CUDA device: ``torch.cuda.get_device_capability()`` returns
    :data:`GPU_CAPABILITY` instead of raising (module docstring: sglang's DSA server-args resolution)."""
    with _without_cuda(get_device_capability=lambda device=None: GPU_CAPABILITY):
        yield


def init_parallel(args, tp_rank: int) -> None:
    """Publish ``args`` (sglang ``ServerArgs``) as this process's config at world rank ``tp_rank``
    and, once per process, build sglang's parallel groups on gloo over the current torch.distributed
    world (initialised here from the env:// variables when it is not yet)."""
    global _PARALLEL
    import torch.distributed as dist
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish

    with gpu_capability_stand_in():
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=tp_rank))
    if _PARALLEL is not None:
        if _PARALLEL != (args.tp_size, args.ep_size):
            raise RuntimeError(
                f"sglang's parallel groups were built for tp/ep {_PARALLEL} in this process, "
                f"not {(args.tp_size, args.ep_size)}"
            )
        return
    if not dist.is_initialized():
        dist.init_process_group("gloo", world_size=args.tp_size, rank=tp_rank)
    if dist.get_world_size() != args.tp_size:
        raise RuntimeError(
            f"the torch.distributed world has {dist.get_world_size()} ranks; the engine has tp_size {args.tp_size}"
        )
    init_distributed_environment(
        world_size=args.tp_size, rank=tp_rank, local_rank=tp_rank, backend="gloo", distributed_init_method=None
    )
    initialize_model_parallel(backend="gloo")
    _PARALLEL = (args.tp_size, args.ep_size)


def model_class(model_config):
    """The sglang class for the config's architecture (its own module, :data:`MODULES` or
    :data:`DRAFT_MODULES`, else sglang's registry)."""
    arch = (getattr(model_config.hf_config, "architectures", None) or [None])[0]
    module = MODULES.get(arch) or DRAFT_MODULES.get(arch)
    if module is not None:
        entry = importlib.import_module(f"sglang.srt.models.{module}").EntryClass
        for cls in entry if isinstance(entry, list) else [entry]:
            if cls.__name__ == arch:
                return cls
    from sglang.srt.model_loader.utils import get_model_architecture

    return get_model_architecture(model_config)[0]


@contextlib.contextmanager
def known_architecture(cls):
    """While sglang's loader reads the quantization config (``_get_quantization_config``: the class's
    ``packed_modules_mapping`` / ``remap_prefix``), its ``get_model_architecture`` answers ``cls``, the
    class :func:`model_class` found, instead of importing every model module through the registry."""
    import sglang.srt.model_loader as package
    from sglang.srt.model_loader import loader

    real = loader.get_model_architecture, package.get_model_architecture
    loader.get_model_architecture = package.get_model_architecture = lambda model_config: (cls, cls.__name__)
    try:
        yield
    finally:
        loader.get_model_architecture, package.get_model_architecture = real


def install_expert_location(model_config) -> Any:
    """sglang's ``ExpertLocationMetadata`` for this rank, computed and installed process-wide as the model
    runner does before it loads the model (``model_executor/model_runner.py``
    ``maybe_init_expert_location_metadata``: ``set_global_expert_location_metadata(
    compute_initial_expert_location_metadata(model_config, moe_ep_rank))``; ``eplb/expert_location.py``:
    with the default ``--init-expert-location trivial``, ``ExpertLocationMetadata.init_trivial``, and None
    for a class without ``get_model_config_for_expert_location``). ``FusedMoE.weight_loader`` then maps
    each checkpoint expert through it (``logical_to_all_physical``). sglang sets it once per engine
    process; here one process may build several engines (tests), each installing its own
    (``allow_overwrite``, as ``publish`` is last-publish-wins). Call under :func:`known_architecture`."""
    from sglang.srt.eplb.expert_location import (
        compute_initial_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.runtime_context import get_parallel

    meta = compute_initial_expert_location_metadata(model_config=model_config, moe_ep_rank=get_parallel().moe_ep_rank)
    set_global_expert_location_metadata(meta, allow_overwrite=True)
    return meta


@contextlib.contextmanager
def no_cuda_sync():
    """While active and only without a CUDA device: ``torch.cuda.synchronize()`` does nothing instead of
    raising (sglang's ``set_embed_and_head`` calls it after sharing the target's tensors, ``models/glm4_moe.py``,
    ``models/deepseek_v2.py``)."""
    with _without_cuda(synchronize=lambda device=None: None):
        yield


def _without_cuda(**stand_ins):
    """``runtime.scoped_attrs.module_attrs(torch.cuda, **stand_ins)`` when no CUDA device exists; nothing
    otherwise (a real device answers for itself)."""
    return contextlib.nullcontext() if torch.cuda.is_available() else module_attrs(torch.cuda, **stand_ins)


class SglangModel:
    """sglang's model class for ``model_path`` at engine TP rank ``tp_rank`` of ``tp_size`` (on CPU).

    ``load(named_tensors)``: one ``load_weights`` call, as sglang's weight updater per bucket.
    ``poison()`` / ``unwritten()``: the written check of a full sync (module docstring).

    ``draft_of``: the target :class:`SglangModel` of a speculative engine: this one is then its draft, built
    as sglang's draft worker builds it (``ModelConfig.from_server_args(..., model_path=draft_path,
    is_draft_model=True)``: ``configs/model_config.py`` renames the architecture to the draft class, e.g.
    ``Glm4MoeForCausalLM`` -> ``Glm4MoeForCausalLMNextN``), in the target's parallel groups and expert
    location, sharing the target's embedding and head (``speculative/eagle_worker_v2.py`` ``init_lm_head``:
    ``set_embed_and_head(*target.get_embed_and_head())``). Those shared tensors are the target's: the
    draft neither poisons, checks, releases nor counts them (:meth:`own_params`)."""

    def __init__(
        self,
        model_path: str,
        tp_size: int,
        tp_rank: int,
        ep_size: int = 1,
        dtype: torch.dtype | str | None = None,
        init_expert_location: str = "trivial",
        custom_weight_loader: list[str] | None = None,
        draft_of: "SglangModel | None" = None,
        draft_path: str | None = None,
    ):
        install_import_stubs()
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_loader.loader import _get_quantization_config, resolve_shared_experts_config
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.runtime_context import get_model

        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.is_draft = draft_of is not None
        if draft_of is None:
            self.args = server_args(
                model_path, tp_size, ep_size, dtype or "auto", init_expert_location, custom_weight_loader
            )
            init_parallel(self.args, tp_rank)
            self.model_config = ModelConfig.from_server_args(self.args)
        else:  # the draft worker's model config (eagle_worker_v2.py: TpModelWorker(is_draft_worker=True))
            self.args = draft_of.args
            self.model_config = ModelConfig.from_server_args(
                self.args, model_path=draft_path or model_path, is_draft_model=True
            )
        load_config = LoadConfig(load_format="dummy")
        from sglang.srt.configs.update_config import adjust_tp_num_heads_if_necessary

        # the ``linear_num_{key,value}_heads_cpu`` head counts that the Gated DeltaNet classes read on the CPU
        # platform (set by model_runner.py's ``adjust_config_with_unaligned_cpu_tp`` on CPU, whose other
        # CPU-only paddings of heads and intermediate sizes a GPU engine does not make: not applied)
        for hf_cfg in (self.model_config.hf_config, getattr(self.model_config.hf_config, "text_config", None)):
            if hf_cfg is not None:
                adjust_tp_num_heads_if_necessary(hf_cfg, tp_size, True)
        cls = model_class(self.model_config)
        with known_architecture(cls):
            quant_config = _get_quantization_config(self.model_config, load_config)
            # the draft runs in the target's expert location (installed once per engine process)
            self.expert_location: Any = (
                draft_of.expert_location if draft_of else install_expert_location(self.model_config)
            )
        # loader.py DefaultModelLoader.load_model + _initialize_model, device "cpu"
        with set_default_torch_dtype(self.model_config.dtype), torch.device("cpu"):
            shared = resolve_shared_experts_config(cls, self.model_config.hf_config, quant_config)
            with get_model().override(shared_experts=shared):
                self.model = cls(config=self.model_config.hf_config, quant_config=quant_config)
            self.model.shared_experts_config = shared
        self.model.eval()
        self.released = False
        self.backup: dict | None = None  # --enable-weights-cpu-backup's host copy while released
        arch = (getattr(self.model_config.hf_config, "architectures", None) or [None])[0]
        self.kept = KEPT_FROM_START.get(arch, ())  # parameter prefixes the sync never writes
        self.shared: set[int] = set()  # ids of the target's tensors a draft holds (set_embed_and_head)
        if draft_of is not None:
            embed, head = draft_of.model.get_embed_and_head()
            with no_cuda_sync():
                self.model.set_embed_and_head(embed, head)
            self.shared = {id(embed), id(head)}

    def own_params(self) -> dict[str, torch.Tensor]:
        """This model's own parameters (a draft's shared embedding and head are the target's)."""
        return {n: p for n, p in self.model.named_parameters() if id(p) not in self.shared}

    def synced_params(self) -> dict[str, torch.Tensor]:
        """The parameters a full weight sync writes (its own, but the :attr:`kept` prefixes)."""
        return {n: p for n, p in self.own_params().items() if not (self.kept and n.startswith(self.kept))}

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    @torch.no_grad()
    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket -> one ``model.load_weights(list)`` call (weight_updater.py). sglang's loaders
        may write into the tensors they are given (gpt-oss zeroes ``down_proj_bias`` on MoE TP ranks
        > 0): pass tensors nothing else reads afterwards."""
        if self.released:
            raise RuntimeError("weights are released (release_memory_occupation); resume them before loading")
        self.model.load_weights([(n, t) for n, t in named_tensors])

    @torch.no_grad()
    def poison(self) -> None:
        """Fill every floating-point parameter a sync writes (:meth:`synced_params`) with NaN (before a full sync)."""
        for p in self.synced_params().values():
            if p.is_floating_point():
                p.data.fill_(float("nan"))

    @torch.no_grad()
    def unwritten(self) -> list[str]:
        """Parameters with a NaN left since :meth:`poison` (not, or not completely, written)."""
        return [n for n, p in self.synced_params().items() if p.is_floating_point() and torch.isnan(p).any()]

    def check_written(self) -> None:
        """Raise (one line naming them) when a parameter was not written since :meth:`poison`."""
        bad = self.unwritten()
        if bad:
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise RuntimeError(
                f"sglang {SGLANG_VERSION}'s {'draft ' if self.is_draft else ''}{type(self.model).__name__}.load_weights left "
                f"{len(bad)} parameter(s) of engine TP rank {self.tp_rank} unwritten by this "
                f"weight update: {', '.join(bad[:3])}{more}"
            )

    def resident_bytes(self) -> int:
        return sum(p.untyped_storage().nbytes() for p in self.own_params().values())

    def release(self, cpu_backup: bool = False) -> None:
        """The memory saver's pause: the parameters' storage goes (contents lost unless
        ``cpu_backup``, sglang's ``--enable-weights-cpu-backup``)."""
        params = self.own_params()
        self.backup = {n: p.data.clone() for n, p in params.items()} if cpu_backup else None
        for p in params.values():
            p.data.untyped_storage().resize_(0)
        self.released = True

    def resume(self) -> None:
        """Storage back: the host copy restored (CPU backup), else zero-filled (sglang's memory saver)."""
        backup = self.backup
        for n, p in self.own_params().items():
            p.data.untyped_storage().resize_(p.numel() * p.element_size())
            p.data.copy_(backup[n]) if backup is not None else p.data.zero_()
        self.backup = None
        self.released = False
