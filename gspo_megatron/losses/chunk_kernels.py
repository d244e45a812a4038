"""The per-chunk softmax arithmetic of the fused log-prob head, eager or compiled by torch.compile.

:mod:`gspo_megatron.losses.fused_logprobs` runs, per chunk of c tokens, one GEMM (h @ W_r^T, in the
weight's dtype: cuBLAS) and then elementwise work on its [c, V/tp] output. Eager PyTorch spends that
work as about eight passes over an fp32 [c, V/tp] tensor in forward (cast, divide, max, subtract, exp,
sum, multiply, sum) and ten in backward; on a GPU those passes, not the GEMMs, made the head 1.7-1.8x
the time of the full log_softmax (docs/gpu.md). The compiled kernels read the GEMM's low-precision
output once or twice per pass of the math and keep the fp32 values in registers (Inductor fuses the
reductions of :func:`stats_math` and the whole of :func:`grad_math` into a few kernels); the math and
the fp32 accumulation are the same, only the reduction order differs (tested to 1e-6).

Shapes: c tokens in the chunk, V/tp this rank's valid vocab columns, K targets per token.

Two forms of one piece of math:
- eager: in place, one fp32 [c, V/tp] temporary at a time (what the planner's chunk budget counts);
- compiled (``torch.compile(dynamic=True)``): out of place, written for Inductor to fuse.

:func:`chunk_ops` picks one: ``"auto"`` compiles on CUDA when Triton is there (the GPU user's path)
and runs eager elsewhere (CPU: the C++ compile costs seconds per shape family, the eager passes are
not what is slow there). ``"compiled"`` forces the compiled form (tests use it on CPU through
Inductor's C++ backend); ``"eager"`` forces eager. Under ``"auto"`` the first head per logits dtype
compiles both graphs on a tiny input first (:func:`_probe`; the graphs are dynamic, so every chunk
reuses them); if compiling fails (no compiler toolchain on the node, say: dynamo's exceptions, nothing
else), one warning names the cause and the process stays eager, before any chunk size is chosen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import Tensor
from torch._dynamo.exc import TorchDynamoException

from gspo_megatron.losses.chunking import softmax_chunk_grad

log = logging.getLogger(__name__)

Kernels = Literal["auto", "eager", "compiled"]
KERNELS = ("auto", "eager", "compiled")
# Graphs per compiled function: one per logits dtype, times a last chunk of one token (a size-1
# specialization), times K (a constant of grad_math's graph), times inference vs no-grad mode.
# Dynamo's default of 8 could be reached by one run; past it, fullgraph fails hard.
RECOMPILE_LIMIT = 32


def stats_eager(
    logits: Tensor, col: Tensor, in_shard: Tensor, temperature: float, cdt: torch.dtype, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """One chunk's local softmax statistics from its GEMM output.

    logits [c, V/tp] (weight dtype; overwritten when already ``cdt``: pass the GEMM output on); col,
    in_shard [c, K] (``chunking.local_targets``).
    Returns (m_r [c] = max_v z, S_r [c] = sum_v exp(z - m_r), E_r [c] = sum_v exp(z - m_r) (z - m_r)
    or None, z_y [c, K] (0 where the target is not in this shard)), z = logits / T in ``cdt``.
    """
    z = logits.to(cdt).div_(temperature)
    del logits  # the caller passed the GEMM output on: one fp32 temporary from here
    zy = z.gather(1, col)
    zy = torch.where(in_shard, zy, torch.zeros_like(zy))
    m = z.max(dim=-1).values
    z.sub_(m[:, None])
    e = torch.exp(z)
    s = e.sum(dim=-1)
    ent = e.mul_(z).sum(dim=-1) if with_entropy else None
    return m, s, ent, zy


def stats_math(
    logits: Tensor, col: Tensor, in_shard: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`stats_eager`'s math out of place, the form torch.compile fuses; always with E_r (one
    more sum in the same pass) and in fp32 (fp64 for fp64 logits), so that one graph per dtype serves
    every call."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    zy = torch.where(in_shard, z.gather(1, col), 0.0)
    m = z.amax(dim=-1)
    zs = z - m[:, None]
    e = torch.exp(zs)
    return m, e.sum(dim=-1), (e * zs).sum(dim=-1), zy


def grad_eager(
    logits: Tensor,
    norm: Tensor,
    temperature: float,
    entropy: Tensor | None,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    col: Tensor,
    in_shard: Tensor,
) -> Tensor:
    """The gradient of one chunk's logits, in the logits' dtype (the GEMM dtype of grad_h and grad_W).

    logits [c, V/tp] (overwritten, as in :func:`stats_eager`); norm [c] = m + log S (log p_v =
    logits / T - norm); entropy [c] H (with grad_entropy); grad_logprobs [c, K] (0 for ignored
    targets) and / or grad_entropy [c]; col, in_shard [c, K]. Returns g / T [c, V/tp] with g from
    ``chunking.softmax_chunk_grad``.
    """
    dtype = logits.dtype
    logp = logits.to(norm.dtype).div_(temperature).sub_(norm[:, None])
    del logits  # as in stats_eager
    g = softmax_chunk_grad(logp, entropy, grad_logprobs, grad_entropy, col, in_shard)
    return g.div_(temperature).to(dtype)


def grad_math(
    logits: Tensor,
    norm: Tensor,
    temperature: float,
    entropy: Tensor,
    grad_logprobs: Tensor,
    grad_entropy: Tensor,
    col: Tensor,
    in_shard: Tensor,
) -> Tensor:
    """:func:`grad_eager`'s math out of place with both gradients always given (zeros stand for a
    missing one: -0 and + 0 leave the other term's value exactly as eager computes it), so that one
    graph per dtype serves every call; the target columns are added by comparison with a column index
    rather than a scatter, so that one fused kernel reads the logits and writes g (no [c, V/tp]
    temporary: the K targets are a loop in the graph, not a reduction over a [c, V/tp, K] comparison)."""
    logp = logits.to(norm.dtype) / temperature - norm[:, None]
    p = torch.exp(logp)
    g = (logp + entropy[:, None]) * p * (-grad_entropy[:, None]) - p * grad_logprobs.sum(dim=-1)[:, None]
    cols = torch.arange(logits.shape[1], device=logits.device)[None, :]
    for k in range(col.shape[1]):  # K is a constant of the graph (one graph per K): K compares per element
        hit = (cols == col[:, k : k + 1]) & in_shard[:, k : k + 1]
        g = g + torch.where(hit, grad_logprobs[:, k : k + 1], 0.0)
    return (g / temperature).to(logits.dtype)


def _compiled_forms() -> tuple[Callable, Callable]:
    """(stats, grad) with :func:`stats_eager` / :func:`grad_eager`'s signatures, calling the
    compiled graphs of :func:`stats_math` / :func:`grad_math`."""
    stats_c = torch.compile(stats_math, dynamic=True, fullgraph=True)
    grad_c = torch.compile(grad_math, dynamic=True, fullgraph=True)

    def stats(logits, col, in_shard, temperature, cdt, with_entropy):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            m, s, ent, zy = stats_c(logits, col, in_shard, temperature)
        return m, s, (ent if with_entropy else None), zy

    def grad(logits, norm, temperature, entropy, grad_logprobs, grad_entropy, col, in_shard):
        zeros = norm.new_zeros(norm.shape)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return grad_c(
                logits,
                norm,
                temperature,
                zeros if entropy is None else entropy,
                col.new_zeros(col.shape, dtype=norm.dtype) if grad_logprobs is None else grad_logprobs,
                zeros if grad_entropy is None else grad_entropy,
                col,
                in_shard,
            )

    return stats, grad


@dataclass(frozen=True)
class ChunkOps:
    """The two per-chunk functions of the fused head and the form they run in."""

    form: str  # "eager" | "compiled"
    stats: Callable[..., tuple[Tensor, Tensor, Tensor | None, Tensor]]
    grad: Callable[..., Tensor]
    fp32_temporaries: bool  # eager: [c, V/tp] temporaries in fp32; compiled: only in the GEMM's dtype

    def temp_bytes(self, dtype: torch.dtype) -> int:
        """Bytes per element of the chunk's [c, V/tp] temporaries (``chunking.chunk_tokens``): fp32
        eager; the logits' dtype compiled (bf16: two per chunk, the GEMM output and g, in the bytes
        of one fp32 one at half the tokens)."""
        return 4 if self.fp32_temporaries else torch.empty(0, dtype=dtype).element_size()


EAGER = ChunkOps("eager", stats_eager, grad_eager, True)
_compiled: ChunkOps | None = None
_auto_failed: str | None = None  # why compiling failed under "auto" (then eager for the process)
_probed: set[tuple[str, torch.dtype]] = set()  # (device type, logits dtype) whose graphs compiled


def _compiled_ops() -> ChunkOps:
    global _compiled
    if _compiled is None:
        _compiled = ChunkOps("compiled", *_compiled_forms(), False)
    return _compiled


def _failed(exc: Exception) -> None:
    """Record why compiling failed under ``"auto"`` and warn once: the process runs eager from here."""
    global _auto_failed
    _auto_failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    log.warning("fused log-prob head: torch.compile failed (%s); running eager", _auto_failed)


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    """Compile both graphs for ``dtype`` logits on a two-token, three-column input before the caller
    picks its chunk size from the form (:meth:`ChunkOps.temp_bytes`): the graphs are dynamic in every
    size, so the real chunks reuse them, and a toolchain that cannot build them is found here, not
    in the middle of a head already chunked for compiled temporaries."""
    ops = _compiled_ops()
    cdt = torch.promote_types(dtype, torch.float32)
    col = torch.zeros(2, 1, dtype=torch.long, device=device)
    hit = torch.ones(2, 1, dtype=torch.bool, device=device)
    zero = torch.zeros(2, dtype=cdt, device=device)
    try:
        ops.stats(torch.zeros(2, 3, dtype=dtype, device=device), col, hit, 1.0, cdt, True)
        ops.grad(torch.zeros(2, 3, dtype=dtype, device=device), zero, 1.0, zero, zero[:, None], zero, col, hit)
    except TorchDynamoException as exc:  # Inductor / Triton could not build: eager is the same math
        _failed(exc)
    _probed.add((device.type, dtype))


def _guarded(ops: ChunkOps) -> ChunkOps:
    """``ops`` whose first failure to compile (a graph the probe did not build: a one-token chunk, K
    targets) warns once and falls back to eager for the process. The head that fails runs eager at the
    chunk size chosen for compiled temporaries (fp32 ones then, twice the bytes of its budget for bf16);
    later heads choose eager chunks."""

    def call(name: str):
        def run(*args):
            if _auto_failed is None:
                try:
                    return getattr(ops, name)(*args)
                except TorchDynamoException as exc:  # Inductor / Triton could not build: eager is the same math
                    _failed(exc)
            return getattr(EAGER, name)(*args)

        return run

    return ChunkOps("compiled", call("stats"), call("grad"), False)


def chunk_ops(device: torch.device, kernels: Kernels = "auto", dtype: torch.dtype | None = None) -> ChunkOps:
    """The per-chunk functions for ``dtype`` logits on ``device`` (see the module docstring for the
    choice; under ``"auto"`` on a GPU the first call per dtype compiles, :func:`_probe`)."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    if kernels == "eager":
        return EAGER
    if kernels == "compiled":
        return _compiled_ops()
    if device.type != "cuda" or _auto_failed is not None:
        return EAGER
    from torch.utils._triton import has_triton

    if not has_triton():
        return EAGER
    if dtype is not None and (device.type, dtype) not in _probed:
        _probe(device, dtype)
    return EAGER if _auto_failed is not None else _guarded(_compiled_ops())
