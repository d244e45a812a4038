"""The CPU compatibility layer: lets Megatron-Core's MoE GPT model, schedules, DDP, optimizer and
dist_checkpointing run without CUDA (gloo instead of NCCL). Active only when no GPU is present.

Megatron-Core hard-codes CUDA in a handful of places (``torch.cuda.current_device()`` as a device,
``torch.cuda.Stream``/``Event`` in the MoE dispatcher, ``device="cuda"`` masks, CUDA RNG state in the
model-parallel RNG tracker, tensor type strings). Instead of patching torch globally, each listed
Megatron module gets its own ``torch`` name rebound to a proxy that differs from torch in two ways
only:

- ``proxy.cuda`` is a CPU shim (streams and events are no-ops, ``current_device()`` is ``"cpu"``,
  the "CUDA" RNG is the CPU generator);
- tensor factories (``torch.empty/zeros/ones/arange/...``) map ``device="cuda"`` to the CPU.

Everything else is the real torch. A few functions are replaced where a proxy cannot reach (noted
at each patch). ``activate()`` is idempotent and a no-op when CUDA is available.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import types

import torch

log = logging.getLogger(__name__)

# Megatron modules whose `torch` global is rebound (each has CUDA-only call sites on our code path).
_PROXIED_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.utils",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",  # MLA (DeepSeek) YaRN
    "megatron.core.models.common.embeddings.language_model_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.transformer_block",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.ssm.gated_delta_net",  # Qwen3-Next / Qwen3.5: parameters built on torch.cuda.current_device()
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.optimizer_param_scheduler",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # result all-reduce on "cuda"
    "megatron.core.dist_checkpointing.strategies.fully_parallel",  # torch.cuda.synchronize()
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.utils",
    "megatron.core.rerun_state_machine",
)

_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "arange",
    "tensor",
    "rand",
    "randn",
    "randint",
    "randperm",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "as_tensor",
    "linspace",
    "eye",
    "tril_indices",
    "triu_indices",
)


def _cpu_device(device):
    """Map any CUDA device spec to the CPU; leave others alone."""
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _NoopStream:
    """Stands for torch.cuda.Stream / Event: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _NoopStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def __eq__(self, other):
        return isinstance(other, _NoopStream)

    def __hash__(self):
        return 0


_SINGLETON_STREAM = _NoopStream()


def _make_cuda_shim() -> types.SimpleNamespace:
    """The `torch.cuda` seen by proxied Megatron modules on a CPU-only machine."""
    real = torch.cuda
    shim = types.SimpleNamespace()
    for name in dir(real):  # default: the real attribute (is_available() stays False, etc.)
        if not name.startswith("__"):
            setattr(shim, name, getattr(real, name))
    shim.Stream = _NoopStream
    shim.Event = _NoopStream
    shim.current_stream = lambda *a, **k: _SINGLETON_STREAM
    shim.default_stream = lambda *a, **k: _SINGLETON_STREAM
    shim.stream = lambda *a, **k: contextlib.nullcontext()
    shim.synchronize = lambda *a, **k: None
    shim.current_device = lambda: "cpu"
    shim.device_count = lambda: 0
    shim.set_device = lambda *a, **k: None
    shim.empty_cache = lambda: None
    shim.memory_allocated = lambda *a, **k: 0
    shim.max_memory_allocated = lambda *a, **k: 0
    shim.memory_reserved = lambda *a, **k: 0
    shim.reset_peak_memory_stats = lambda *a, **k: None
    shim.nvtx = types.SimpleNamespace(
        range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None, range=lambda *a, **k: contextlib.nullcontext()
    )
    # The "CUDA" RNG of the model-parallel tracker is the CPU generator.
    shim.get_rng_state = lambda *a, **k: torch.get_rng_state()
    shim.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    shim.manual_seed = lambda seed: torch.manual_seed(seed)
    shim.manual_seed_all = lambda seed: torch.manual_seed(seed)
    # DDP / clip_grads check tensor type strings against these names.
    shim.FloatTensor = torch.FloatTensor
    shim.HalfTensor = torch.HalfTensor
    shim.BFloat16Tensor = torch.BFloat16Tensor
    shim.IntTensor = torch.IntTensor
    shim.LongTensor = torch.LongTensor
    return shim


class _TorchProxy(types.ModuleType):
    """`torch` as seen by one proxied Megatron module. Lookups are cached on first use."""

    def __init__(self, cuda_shim):
        super().__init__("torch")
        self.__dict__["cuda"] = cuda_shim
        for name in _FACTORIES:
            self.__dict__[name] = _wrap_factory(getattr(torch, name))

    def __getattr__(self, name):
        value = getattr(torch, name)
        self.__dict__[name] = value
        return value


_ACTIVE = False


def activate(force: bool = False) -> bool:
    """Install the CPU redirections when CUDA is unavailable (or ``force``). Returns whether active."""
    global _ACTIVE
    if _ACTIVE:
        return True
    if torch.cuda.is_available() and not force:
        return False
    proxy = _TorchProxy(_make_cuda_shim())
    for name in _PROXIED_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # module absent in this megatron-core version
            continue
        if getattr(mod, "torch", None) is torch:
            setattr(mod, "torch", proxy)  # (a module imported by name: its attributes are not typed)
    _patch_rng_tracker()
    _patch_moe_split_sizes()
    _patch_uneven_first_dim_collectives()
    _patch_tied_embedding_setup()
    _patch_type_string_checks()
    _ACTIVE = True
    log.info("CPU compatibility layer for Megatron-Core active")
    return True


def _patch_rng_tracker() -> None:
    # random.py reads CUDA generator state through torch._C, out of a proxy's reach.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _patch_moe_split_sizes() -> None:
    """The alltoall dispatcher turns its split sizes into NumPy arrays only when they live on the
    GPU; on CPU they stay tensors, which ProcessGroup.all_to_all_single rejects."""
    from megatron.core.transformer.moe import token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` rows (dim 0)."""
    if t.shape[0] == rows:
        return t.contiguous()
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def _patch_uneven_first_dim_collectives() -> None:
    """The alltoall dispatcher with expert-tensor parallelism (ETP > 1) all-gathers, over the TP
    group, the tokens each TP rank routes to this rank's experts (``output_split_sizes``: one count
    per TP rank, the same list on every rank of the group), and reduce-scatters their gradients
    (and the experts' outputs) back with the same uneven splits. NCCL takes uneven sizes; gloo's
    all-gather refuses them (``ProcessGroupGloo::allgather: invalid tensor size``).

    Replaced: ``mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` (module
    globals, called by the autograd functions ``_GatherFromSequenceParallelRegion`` and
    ``_ReduceScatterToSequenceParallelRegion`` in forward and backward). With uneven splits
    (sizes n_0..n_{W-1}, m = max n_r) each rank's piece is zero-padded to m rows, the equal-size
    collective runs on [W*m, ...], and the padding is dropped:
      gather:          out = cat_r x_r[:n_r]               (x_r = rank r's padded input)
      reduce-scatter:  out_r = sum_k chunk_{k,r}[:n_r]     (chunk_{k,r} = rank k's r-th split, padded)
    Zero rows add nothing to a sum, so both equal the unpadded collectives exactly. Even splits
    and the no-split path go to Megatron's own functions unchanged."""
    from megatron.core.tensor_parallel import mappings

    if getattr(mappings._gather_along_first_dim, "_gspo_patched", False):
        return
    gather_orig = mappings._gather_along_first_dim
    reduce_scatter_orig = mappings._reduce_scatter_along_first_dim

    def uneven(sizes, group) -> bool:
        return sizes is not None and group is not None and group.size() > 1 and len(set(sizes)) > 1

    @functools.wraps(gather_orig)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if not uneven(output_split_sizes, group):
            return gather_orig(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        rank, m = group.rank(), max(sizes)
        if input_.shape[0] != sizes[rank]:
            raise RuntimeError(
                f"uneven all-gather: rank {rank} holds {input_.shape[0]} rows, output_split_sizes says {sizes[rank]}"
            )
        out = torch.empty((len(sizes) * m, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        torch.distributed.all_gather_into_tensor(out, _pad_rows(input_, m), group=group)
        return torch.cat([out[r * m : r * m + n] for r, n in enumerate(sizes)], dim=0)

    @functools.wraps(reduce_scatter_orig)
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if not uneven(input_split_sizes, group):
            return reduce_scatter_orig(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(n) for n in input_split_sizes]
        rank, m = group.rank(), max(sizes)
        padded = torch.cat([_pad_rows(c, m) for c in torch.split(input_, sizes, dim=0)], dim=0)
        out = torch.empty((m, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
        torch.distributed.reduce_scatter_tensor(out, padded, group=group)
        return out[: sizes[rank]]

    # (function attributes, set with setattr: a type checker knows no attributes on a function)
    setattr(gather, "_gspo_patched", True)
    setattr(reduce_scatter, "_gspo_patched", True)
    mappings._gather_along_first_dim = gather
    mappings._reduce_scatter_along_first_dim = reduce_scatter


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Within the block, ``Tensor.cuda()`` returns the tensor itself (a CPU no-op)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _patch_tied_embedding_setup() -> None:
    """LanguageModule.setup_embeddings_and_output_layer moves the tied embedding copy with
    ``weight.data.cuda()`` (a Tensor method, out of a module proxy's reach) before all-reducing it
    between the first and last pipeline stages."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer
    if getattr(original, "_gspo_patched", False):
        return

    @functools.wraps(original)
    def setup(self, *args, **kwargs):
        with _tensor_cuda_is_identity():
            return original(self, *args, **kwargs)

    setattr(setup, "_gspo_patched", True)  # (a function attribute, see above)
    LanguageModule.setup_embeddings_and_output_layer = setup


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_type_strings():
    """Within the block, ``tensor.type()`` (no argument) of a CPU float tensor answers with the CUDA
    type name Megatron's optimizer code compares against."""
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _wrap_in(owner, attr: str, ctx_factory) -> None:
    """Replace ``owner.attr`` (a function) by one that runs inside ``ctx_factory()``."""
    fn = getattr(owner, attr)
    if getattr(fn, "_gspo_patched", False):
        return

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with ctx_factory():
            return fn(*args, **kwargs)

    setattr(wrapped, "_gspo_patched", True)  # (a function attribute, see above)
    setattr(owner, attr, wrapped)


def _patch_type_string_checks() -> None:
    """The optimizers sort parameters by ``param.type() == 'torch.cuda.FloatTensor'`` and
    clip_grads asserts it (Tensor methods: out of a module proxy's reach)."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    _wrap_in(distrib_optimizer.DistributedOptimizer, "__init__", _cuda_type_strings)
    _wrap_in(optimizer.Float16OptimizerWithFloat16Params, "__init__", _cuda_type_strings)
    _wrap_in(clip_grads, "clip_grad_by_total_norm_fp32", _cuda_type_strings)
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32


def patch_missing_te() -> None:
    """Megatron-Core 0.16 references ``te_general_gemm`` in the MoE router even when Transformer
    Engine failed to import (NameError). Define it as None so the torch fallback runs. Needed on any
    machine without TE, GPU or not; called by ``init_distributed``."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _patch_torch_norm()
    _patch_fp32_optimizer_load()


def _patch_fp32_optimizer_load() -> None:
    """With fp32 parameters the distributed optimizer's main params are views of the model params
    (leaves that require grad), and loading its state copies into them in place outside no_grad
    (RuntimeError). Megatron's usual bf16 path has separate fp32 copies; loading under no_grad is
    right for both."""
    from megatron.core.optimizer import distrib_optimizer

    _wrap_in(distrib_optimizer.DistributedOptimizer, "load_state_dict", torch.no_grad)


def _patch_torch_norm() -> None:
    """Without TE or apex, Megatron's local spec uses WrappedTorchNorm, which refuses sequence
    parallelism (required for MoE with TP). A norm is elementwise over the hidden dim, so it is
    correct on sequence shards; what SP needs is the `sequence_parallel` mark on the weight so that
    finalize_model_grads all-reduces its gradient over the TP group (as TE's and apex's norms do)."""
    from megatron.core.transformer import torch_norm

    if getattr(torch_norm.WrappedTorchNorm, "_gspo_patched", False):
        return

    def __new__(
        cls,
        config,
        hidden_size,
        eps=1e-5,
        persist_layer_norm=False,
        zero_centered_gamma=False,
        normalization="LayerNorm",
    ):
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
        if norm_cls is None or config.layernorm_zero_centered_gamma:
            raise ValueError(
                f"normalization {config.normalization!r} (zero-centered gamma="
                f"{config.layernorm_zero_centered_gamma}) needs Transformer Engine or apex"
            )
        # params_dtype as TE's norms (upstream leaves the cast to Float16Module; without it a bf16
        # model would keep fp32 norm weights, and HF -> Megatron -> HF would change their dtype)
        norm = norm_cls(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)
    torch_norm.WrappedTorchNorm._gspo_patched = True
