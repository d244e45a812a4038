"""FP8 training through Transformer Engine: our config -> Megatron-Core TransformerConfig fields.

Field names and allowed values are those of megatron-core 0.16 ``TransformerConfig``
(``fp8``, ``fp8_recipe``, ``fp8_margin``, ``fp8_amax_history_len``, ``fp8_amax_compute_algo``,
``fp8_param``, ``fp8_wgrad``, ``first_last_layers_bf16``...). Megatron applies the FP8 autocast
itself inside the TE layers when ``config.fp8`` is set, so the model only needs the TE layer spec.
Default (``fp8: null``) is plain bf16. apex is never required.

Called once per rank while building the model config; validation runs before anything heavy and
errors name the offending field (``<prefix>.<key>``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import torch

FORMATS = (None, "e4m3", "hybrid")
RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")
AMAX_ALGOS = ("most_recent", "max")
# Minimum CUDA compute capability per recipe (Ada/Hopper for per-tensor scaling, Hopper for
# blockwise 128x128, Blackwell for MX block scaling).
MIN_CAPABILITY = {"delayed": (8, 9), "tensorwise": (8, 9), "blockwise": (9, 0), "mxfp8": (10, 0)}


@dataclass
class FP8Options:
    """``fp8``: None (bf16) | "e4m3" | "hybrid" (e4m3 forward, e5m2 gradients)."""

    fp8: str | None = None
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_param: bool = False  # keep GEMM weights in fp8 (saves memory; TE decides which)
    wgrad: bool = True
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    moe_router_padding: bool = True  # pad tokens per expert to the FP8 GEMM alignment

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any] | None, prefix: str = "fp8") -> "FP8Options":
        """Build from a config section; unknown keys raise naming ``prefix.key``."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"{prefix}.{key}: unknown FP8 option (known: {sorted(known)})")
        opts = cls(**d)
        opts.validate(prefix)
        return opts

    def validate(self, prefix: str = "fp8") -> None:
        def bad(key: str, msg: str) -> ValueError:
            return ValueError(f"{prefix}.{key}: {msg}")

        if self.fp8 not in FORMATS:
            raise bad("fp8", f"must be null, 'e4m3' or 'hybrid', got {self.fp8!r}")
        if self.recipe not in RECIPES:
            raise bad("recipe", f"must be one of {RECIPES}, got {self.recipe!r}")
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise bad("amax_compute_algo", f"must be one of {AMAX_ALGOS}, got {self.amax_compute_algo!r}")
        for key in ("margin", "amax_history_len", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "amax_history_len" else 0):
                raise bad(key, f"must be an integer >= {1 if key == 'amax_history_len' else 0}, got {v!r}")
        if self.fp8_param and self.fp8 is None:
            raise bad("fp8_param", "needs fp8 set ('e4m3' or 'hybrid')")
        if self.first_last_layers_bf16 and self.recipe == "delayed" and self.fp8 is not None:
            raise bad("first_last_layers_bf16", "not supported with recipe 'delayed' (Megatron-Core)")

    def transformer_config_kwargs(self, *, is_moe: bool = False, token_dispatcher: str = "alltoall") -> dict[str, Any]:
        """Keyword arguments for ``TransformerConfig`` (bf16 params and compute in every case)."""
        kw: dict[str, Any] = {"bf16": True, "params_dtype": torch.bfloat16}
        if self.fp8 is None:
            return kw
        kw.update(
            fp8=self.fp8,
            fp8_recipe=self.recipe,
            fp8_margin=self.margin,
            fp8_amax_history_len=self.amax_history_len,
            fp8_amax_compute_algo=self.amax_compute_algo,
            fp8_param=self.fp8_param,
            fp8_wgrad=self.wgrad,
            first_last_layers_bf16=self.first_last_layers_bf16,
            num_layers_at_start_in_bf16=self.num_layers_at_start_in_bf16,
            num_layers_at_end_in_bf16=self.num_layers_at_end_in_bf16,
        )
        # Megatron rejects router padding with the allgather dispatcher.
        if is_moe and self.moe_router_padding and token_dispatcher not in ("allgather", "alltoall_seq"):
            kw["moe_router_padding_for_quantization"] = True
        return kw


def check_fp8_runtime(opts: FP8Options, prefix: str = "fp8") -> None:
    """Before building an FP8 model: Transformer Engine importable and the GPU new enough.
    No-op for bf16."""
    if opts.fp8 is None:
        return
    if not torch.cuda.is_available():
        raise RuntimeError(f"{prefix}.fp8={opts.fp8!r} needs a CUDA GPU with Transformer Engine; none is visible")
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"{prefix}.fp8={opts.fp8!r} needs transformer-engine (pip install transformer-engine[pytorch])"
        ) from e
    need = MIN_CAPABILITY[opts.recipe]
    have = torch.cuda.get_device_capability()
    if have < need:
        raise RuntimeError(f"{prefix}.recipe={opts.recipe!r} needs compute capability >= {need}, this GPU has {have}")
