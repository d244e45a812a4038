"""Library side of the conversion tools (tools/hf_to_megatron.py, tools/megatron_to_hf.py) and of
the scorer's model loading.

- Validation that runs before any heavy work (no distributed start, no model built):
  ``check_hf_dir``, ``check_world_layout``, ``prepare_output_dir``.
- ``hf_to_megatron`` / ``megatron_to_hf``: collective, called by every rank after
  ``runtime.init_distributed``.
- ``load_model``: this rank's model from an HF directory or a Megatron checkpoint (any layout).

Memory: each rank holds its own model shard (allocated uninitialized: no random init); loading
copies the HF tensors straight from the memory-mapped safetensors files into it; export holds one
gathered parameter at a time per rank, written into the shard files in place
(``safetensors_shards``).

Where the time went (246 MB Qwen3-MoE, fp32, one process, 2-core machine; docs/conversion.md):
HF -> Megatron spent 2.5 of 3.9 s waiting for the spawned Manager server of Megatron's checkpoint
writer to start (``checkpoint.writer`` writes in this process instead), 0.1-0.3 s per garbage
collector pass (``gc_paused``) and two or three copies per tensor (``Rule.load_into``: one);
Megatron -> HF spent its time in dist_checkpointing's load and rank 0's sequential safetensors
write (every owner now writes its own tensors in place).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from gspo_megatron.checkpoint.manager import (
    ASSETS_SUBDIR,
    HF_ASSET_FILES,
    CheckpointError,
    load_checkpoint,
    read_meta,
    resolve_checkpoint,
    write_checkpoint_dir,
)
from gspo_megatron.dtypes import (  # DTYPE_NAMES public here too
    DTYPE_NAMES,
    canonical_name,
    dtype_name,
)
from gspo_megatron.errors import UserInputError, agree, stop_all
from gspo_megatron.runtime import distributed as rdist

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class UsageError(UserInputError):
    """Bad command-line input (message names the argument / file)."""


# --------------------------------------------------------------------------------------------
# validation before heavy work (any process, no communication)
# --------------------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524288000, '1000' -> 1000 (bytes)."""
    m = _SIZE.match(str(text))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise UsageError(f"--max-shard-size {text!r} is not a size like 5GB, 500MB or 1000000")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise UsageError(f"--max-shard-size must be positive, got {text!r}")
    return size


def hf_dtype(hf: dict) -> str:
    """The dtype name stored in an HF config ('torch_dtype' or 'dtype'); float32 when absent."""
    name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    name = canonical_name(name)
    if name not in DTYPE_NAMES:
        raise UsageError(f"config.json dtype {name!r} is not supported ({', '.join(DTYPE_NAMES)})")
    return name


def check_hf_dir(hf_dir: str) -> dict:
    """Validate an HF model directory: config.json readable, architecture supported, safetensors
    headers readable and holding every file the index names. Returns the config dict."""
    from safetensors import safe_open

    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.registry import get_family

    if not os.path.isdir(hf_dir):
        raise UsageError(f"HF directory {hf_dir} does not exist")
    hf = load_hf_config(hf_dir)
    get_family(hf)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UsageError(f"{index} is corrupt: {e}") from None
    elif os.path.exists(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise UsageError(
            f"no model.safetensors or model.safetensors.index.json in {hf_dir} "
            "(only safetensors checkpoints are supported)"
        )
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.exists(path):
            raise UsageError(f"{path} (named in the index) is missing")
        try:
            with safe_open(path, "pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise UsageError(f"corrupt safetensors file {path}: {e}") from None
    return hf


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world_layout(hf: dict, tp: int, pp: int, ep: int, etp: int | None, cp: int = 1) -> None:
    """The layout divides the model's heads / experts / layers and the world size (torchrun's):
    ``parallel_layout.layout_errors`` with the flags' names."""
    from gspo_megatron.parallel_layout import layout_errors

    try:
        errors = layout_errors(tp, pp, ep, etp, cp, world_size=world_size_from_env(), hf=hf, prefix="--")
    except ValueError as e:  # a config.json no family reads
        raise UsageError(str(e)) from None
    if errors:
        raise UsageError("; ".join(errors))


def split_layout(hf: dict, tp: int, pp: int, ep: int, etp: int | None) -> tuple[int, int, int, int | None]:
    """The layout a conversion runs in. A layout given on the command line (any of --tp --pp --ep
    --etp) is kept. With none and N = WORLD_SIZE > 1 ranks (torchrun), the ranks divide the model
    between them instead of each holding a replica: N pipeline stages when N divides the layers
    (each rank reads, holds and writes its layers), else N expert-parallel ranks when N divides the
    experts, else the first P x E = N that fits; a model no split fits stays replicated (every
    rank reads everything; correct, not faster). The checkpoint written loads into any layout."""
    from gspo_megatron.parallel_layout import layout_errors

    world = world_size_from_env()
    if (tp, pp, ep, etp) != (1, 1, 1, None) or world == 1:
        return tp, pp, ep, etp
    pairs = [(world, 1), (1, world)] + [(p, world // p) for p in range(2, world) if world % p == 0]
    for p, e in pairs:
        try:
            if not layout_errors(1, p, e, None, 1, world_size=world, hf=hf, prefix="--"):
                return 1, p, e, None
        except ValueError:
            break
    return tp, pp, ep, etp


def prepare_output_dir(path: str, overwrite: bool) -> None:
    """Refuse a non-empty output directory unless ``overwrite`` (then the writer replaces what it
    writes: the checkpoint directory as a whole, or the model files of an HF directory)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--output {path} exists and is not a directory")
    if os.path.isdir(path) and os.listdir(path):
        if not overwrite:
            raise UsageError(f"--output {path} is not empty (pass --overwrite to replace it)")


def checkpoint_meta(path: str) -> tuple[str, dict]:
    """(checkpoint directory, metadata) for a converted checkpoint, a training step directory or a
    training checkpoint root (newest complete step)."""
    ckpt_dir = resolve_checkpoint(path)[0]
    return ckpt_dir, read_meta(ckpt_dir)


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


# --------------------------------------------------------------------------------------------
# collective work
# --------------------------------------------------------------------------------------------
def _progress(total: int, desc: str, unit: str = "it", unit_scale: bool = False):
    """A tqdm bar on global rank 0 (stderr), a silent stand-in elsewhere."""
    from tqdm import tqdm

    rank0 = rdist.rank() == 0
    quiet = not rank0 or os.environ.get("TQDM_DISABLE", "") not in ("", "0")
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=quiet, file=sys.stderr, dynamic_ncols=True
    )


@contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for a conversion: its full passes over the hundreds of
    thousands of objects torch / Megatron keep alive cost 0.1-0.3 s each (in the pickling of
    dist_checkpointing's metadata exchange), and a conversion makes no reference cycles worth
    collecting. Re-enabled (if it was on) afterwards."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def build_empty_model(
    hf: dict,
    tp: int,
    pp: int,
    ep: int,
    etp: int | None,
    cp: int,
    dtype: str,
    lora: dict | None = None,
    mtp: bool = False,
):
    """This rank's model with uninitialized weights (no random init; filled right after). ``lora``: a
    LoRA checkpoint's ``model.lora`` (its metadata): the adapters are built, loaded and merged on export.
    ``mtp``: a checkpoint of a model holding its MTP layer (``model.mtp``; its metadata's ``mtp``)."""
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.lora import LoraOptions

    return build_model(
        hf,
        tp,
        pp,
        ep,
        etp,
        cp,
        opts=ModelOptions(
            dtype=dtype, perform_initialization=False, lora=LoraOptions(**lora) if lora else None, mtp=mtp
        ),
    )


def load_hf_into(model, hf_dir: str) -> None:
    """Stream the HF safetensors of ``hf_dir`` into this rank's shards, with a progress bar."""
    from gspo_megatron.models.weights import load_hf_weights

    n_params = sum(1 for _ in model.named_parameters())
    with _progress(n_params, "load HF weights", "tensor") as bar:
        load_hf_weights(model, hf_dir, progress=bar.update)


def hf_to_megatron(
    hf_dir: str, output: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, dtype: str | None = None
) -> str:
    """Convert ``hf_dir`` into a Megatron dist checkpoint at ``output`` (collective; every rank
    after init_distributed). The checkpoint loads into any layout. Returns ``output``."""
    from gspo_megatron.models.hf_config import load_hf_config

    hf = load_hf_config(hf_dir)
    with gc_paused():
        model = build_empty_model(hf, tp, pp, ep, etp, 1, dtype or hf_dtype(hf))
        load_hf_into(model, hf_dir)
        return write_checkpoint_dir(output, 0, model, hf_assets_dir=hf_dir, save_rng=False)


def load_model(
    path: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, cp: int = 1, dtype: str | None = None
):
    """This rank's model, weights from an HF directory or a Megatron checkpoint (resharded to the
    current layout). Collective. Returns (model, hf_config)."""
    from gspo_megatron.models.hf_config import load_hf_config

    if is_hf_dir(path):
        hf = load_hf_config(path)
        model = build_empty_model(hf, tp, pp, ep, etp, cp, dtype or hf_dtype(hf))
        load_hf_into(model, path)
        return model, hf
    _, meta = checkpoint_meta(path)
    hf = meta["hf_config"]
    model = build_empty_model(
        hf, tp, pp, ep, etp, cp, dtype or meta.get("dtype") or hf_dtype(hf), meta.get("lora"), bool(meta.get("mtp"))
    )
    load_checkpoint(path, model, restore_rng=False)  # a root falls back past a corrupt newest step
    return model, hf


def write_hf_dir_files(out_dir: str, hf: dict, dtype: str, assets_dir: str | None) -> None:
    """config.json (the checkpoint's HF config, dtype set to what was written) and the tokenizer /
    generation-config files kept with the checkpoint. Rank 0 only."""
    from gspo_megatron.models.hf_config import file_config

    cfg = dict(file_config(hf))  # a vision-language config as its file holds it (text fields not lifted)
    for key in ("torch_dtype", "dtype"):
        if key in cfg or key == "dtype":
            cfg[key] = dtype
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    if assets_dir and os.path.isdir(assets_dir):
        for name in HF_ASSET_FILES:
            src = os.path.join(assets_dir, name)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(out_dir, name))


def hf_tensor_list(items) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, shape, dtype) of every HF tensor of an export plan, in the order
    ``export_hf_weights`` yields them (a stacked expert tensor [E, ...] where its last row comes)."""
    out: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    rows: dict[str, int] = {}
    for it in items:
        if it.stack is None:
            out.extend((n, tuple(s), it.dtype) for n, s in zip(it.hf_names, it.hf_shapes))
            continue
        count = it.stack[1]
        for n, s in zip(it.hf_names, it.hf_shapes):
            rows[n] = rows.get(n, 0) + 1
            if rows[n] == count:
                out.append((n, (count, *s), it.dtype))
    return out


def export_to_hf_dir(
    model, hf: dict, out_dir: str, max_shard_size: int, assets_dir: str | None = None
) -> list[str] | None:
    """Write this model as an HF directory (collective; every rank writes its own tensors).

    The export plan (``models.weights.build_export_plan``, global) fixes every HF tensor's shard
    file and byte range before any data moves (``safetensors_shards``): rank 0 creates the files
    (headers, sizes); then each item's owner -- the first data-parallel replica's tensor-parallel
    rank 0, after the (E)TP all-gather of its group -- ``pwrite``s the full HF tensors into place
    (a stacked expert tensor: each expert's row at its offset). Nothing is sent to rank 0; each
    rank holds one gathered parameter at a time. With N pipeline / expert-parallel ranks the N
    owners write disjoint parts of the files at once. The files are the bytes
    ``safetensors.torch.save_file`` writes for the same tensors, cut into shards exactly as before
    (stream order, at most ``max_shard_size`` bytes, a larger single tensor alone). ``out_dir``
    must be on a filesystem every rank sees (as checkpoints already need). The MTP layers of
    ``assets_dir`` (a checkpoint's ``hf_assets/carried.safetensors`` or the source HF directory's own
    shards: ``models/carried.py``) are written unchanged by rank 0, after the trained tensors.
    Returns the safetensors file names on rank 0, None elsewhere."""

    from gspo_megatron.checkpoint import safetensors_shards as st
    from gspo_megatron.models.carried import CarriedTensors, mtp_names
    from gspo_megatron.models.weights import build_export_plan, gather_full

    me = rdist.rank()
    items, mine = build_export_plan(model)
    # the MTP layers, unchanged (models/carried.py), less what the model exports itself (its trained MTP
    # layer, model.mtp: models/mtp.py; then only the layer's embed_tokens / shared_head.head); rank 0 writes them
    exported = {n for it in items for n in it.hf_names}
    carried = CarriedTensors(assets_dir, hf, exclude=exported, mtp_trained=bool(mtp_names(hf, exported)))
    shards = st.plan_shards(hf_tensor_list(items) + carried.entries(), max_shard_size)
    if me == 0:
        os.makedirs(out_dir, exist_ok=True)
        for name in os.listdir(out_dir):  # a previous export's shards would mix with ours
            if name.startswith("model") and ".safetensors" in name or name.startswith(".part-"):
                os.remove(os.path.join(out_dir, name))
        st.create_files(out_dir, shards)
    rdist.barrier()
    files = st.ShardFiles(out_dir, shards)
    total = sum(it.nbytes for it in items)
    with _progress(total, "export HF weights", "B", unit_scale=True) as bar:
        for it in items:
            tensors = gather_full(it, mine) if it.global_name in mine else None
            if tensors is not None and me == it.owner:
                for name, t in zip(it.hf_names, tensors):
                    files.write(name, t, None if it.stack is None else it.stack[0])
            bar.update(it.nbytes)
    if me == 0:
        for name in carried.names:
            files.write(name, carried.get(name))
    carried.close()
    files.close()
    rdist.barrier()
    if me != 0:
        return None
    names = st.finish_files(out_dir, shards)
    write_hf_dir_files(out_dir, hf, dtype_name(model.config.params_dtype), assets_dir)
    return names


def megatron_to_hf(
    checkpoint: str,
    output: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    max_shard_size: int = 5 * 10**9,
) -> list[str] | None:
    """Export a Megatron checkpoint (converted or training; root or step directory) to an HF
    directory, loading it resharded into the current layout (collective)."""
    ckpt_dir, meta = checkpoint_meta(checkpoint)
    with gc_paused():
        model, hf = load_model(checkpoint, tp, pp, ep, etp, 1)
        return export_to_hf_dir(model, hf, output, max_shard_size, os.path.join(ckpt_dir, ASSETS_SUBDIR))


# --------------------------------------------------------------------------------------------
# CLI plumbing shared by the tools
# --------------------------------------------------------------------------------------------
EXPECTED_ERRORS = (UsageError, ValueError, FileNotFoundError, KeyError, CheckpointError)


@contextmanager
def cli_errors(prog: str) -> Iterator[None]:
    """Turn expected errors into ``prog: error: <one line>`` on stderr (global rank 0 only) and exit
    status 2. Under torchrun, a rank failing its checks before :func:`run_distributed` agrees with
    the others (which call :func:`~gspo_megatron.errors.agree` at its start), so every rank stops
    and the line is printed once."""
    import torch.distributed as dist

    try:
        yield
    except EXPECTED_ERRORS as e:
        together = not dist.is_initialized()  # agree() makes every rank stop with the first error
        error: BaseException | None = agree(e) if together else e
        assert error is not None  # this rank failed: agree() returns an error
        raise SystemExit(stop_all(prog, error, debug=False, together=together)) from None


def add_layout_args(parser, with_cp: bool = False) -> None:
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    if with_cp:
        parser.add_argument("--cp", type=int, default=1, help="context parallel size (GPU only)")


def run_distributed(
    fn: Callable[[], object], tp: int, pp: int, ep: int, etp: int | None, cp: int = 1, seed: int = 1234
):
    """init_distributed, run ``fn``, tear down (also on errors)."""
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    error = agree(None)  # the ranks whose checks failed are in cli_errors' agree()
    if error is not None:
        raise error
    init_distributed(ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp), seed=seed)
    try:
        return fn()
    finally:
        destroy_distributed()
