"""Distributed checkpoints: Megatron-Core ``dist_checkpointing`` (torch_dist format), atomic and
resumable, loadable into any TP/PP/EP layout (the model part; the optimizer resumes in the layout
it was written from).

One checkpoint directory (``ckpt_root/step_000010/``, or any directory the converter writes)::

    dist/                 dist_checkpointing output: model (+ optimizer) sharded tensors
    rng/rank_00000.pt     per-rank RNG states (torch, numpy, python, CUDA, Megatron tracker)
    trainer_state.pt      rank 0: scheduler state_dict and the caller's extra_state
    hf_assets/            tokenizer files + generation_config.json (when given), for HF export
    gspo_checkpoint.json  metadata: step, HF config of the model, layout written from, dtype
    COMPLETE              marker, written last

Atomicity: every rank writes into ``step_X.tmp-<nonce>/``; after a barrier rank 0 fsyncs, writes
the marker, renames the directory to ``step_X/`` and replaces the ``latest`` pointer file
(temp file + ``os.replace``). A kill at any moment leaves the newest complete checkpoint loadable;
``*.tmp-*`` directories are ignored (and removed by the next save). A checkpoint that fails
validation or loading falls back to the previous one with a warning.

Every function here is collective (all ranks call it) unless its docstring says otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import uuid
import warnings
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from gspo_megatron.checkpoint.in_place_reads import direct_reads, merge_swiglu_in_place
from gspo_megatron.checkpoint.writer import direct_writes
from gspo_megatron.dtypes import dtype_name
from gspo_megatron.runtime import distributed as rdist
from gspo_megatron.runtime.files import fsync_dir, fsync_file, write_atomic

log = logging.getLogger(__name__)

META_FILE = "gspo_checkpoint.json"
MARKER_FILE = "COMPLETE"
LATEST_FILE = "latest"
DIST_SUBDIR = "dist"
ASSETS_SUBDIR = "hf_assets"
FORMAT_VERSION = 1
# Resumes the optimizer in the same layout (DP resharding allowed); the model part always reshards.
_SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
_STEP_DIR = re.compile(r"^step_(\d+)$")
HF_ASSET_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or incompatible (message names the path)."""


# --------------------------------------------------------------------------------------------
# helpers (any rank, no communication unless noted)
# --------------------------------------------------------------------------------------------
def _broadcast(obj):
    """Rank 0's ``obj`` on every rank (collective)."""
    from gspo_megatron.runtime.distributed import broadcast_object

    return broadcast_object(obj)


def _all_ok(ok: bool) -> bool:
    """True when ``ok`` holds on every rank (collective)."""
    from gspo_megatron.runtime.distributed import any_rank

    return not any_rank(not ok)


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers (anything with ``.module``)."""
    while hasattr(model, "module") and not hasattr(model, "hf_config"):
        model = model.module
    return model


def current_layout() -> dict:
    """This run's parallel layout (needs Megatron's parallel state)."""
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        world_size=rdist.world_size(),
    )


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _fsync_tree(root: str) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def read_meta(ckpt_dir: str) -> dict:
    """The metadata JSON of a checkpoint directory (any rank). Raises CheckpointError."""
    path = os.path.join(ckpt_dir, META_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir} is not a gspo-megatron checkpoint (no {META_FILE})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt: {e}") from None


def validate_checkpoint_dir(ckpt_dir: str) -> str | None:
    """Why ``ckpt_dir`` is not a complete checkpoint, or None when it looks complete (any rank;
    a cheap check of files, not of tensor contents)."""
    if not os.path.isdir(ckpt_dir):
        return f"{ckpt_dir} does not exist or is not a directory"
    if not os.path.exists(os.path.join(ckpt_dir, MARKER_FILE)):
        return f"{ckpt_dir} is incomplete (no {MARKER_FILE} marker: the save did not finish)"
    try:
        meta = read_meta(ckpt_dir)
    except CheckpointError as e:
        return str(e)
    for key in ("step", "hf_config", "layout"):
        if key not in meta:
            return f"{os.path.join(ckpt_dir, META_FILE)} lacks {key!r}"
    dist_dir = os.path.join(ckpt_dir, DIST_SUBDIR)
    if not os.path.exists(os.path.join(dist_dir, "metadata.json")) or not os.path.exists(
        os.path.join(dist_dir, ".metadata")
    ):
        return f"{dist_dir} is not a complete dist_checkpointing directory"
    return None


def list_checkpoints(ckpt_root: str) -> list[tuple[int, str]]:
    """(step, path) of the ``step_*`` directories under ``ckpt_root``, oldest first (any rank;
    temporary ``*.tmp-*`` directories are not listed)."""
    if not os.path.isdir(ckpt_root):
        return []
    out = []
    for name in os.listdir(ckpt_root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(ckpt_root, name)):
            out.append((int(m.group(1)), os.path.join(ckpt_root, name)))
    return sorted(out)


def latest_checkpoint(ckpt_root: str) -> str | None:
    """Path of the newest complete checkpoint under ``ckpt_root`` (any rank), or None. Incomplete
    ones are skipped with a warning. The ``latest`` pointer is informational: a complete newer
    directory wins (a crash may fall between the rename and the pointer update)."""
    for _, path in reversed(list_checkpoints(ckpt_root)):
        problem = validate_checkpoint_dir(path)
        if problem is None:
            return path
        warnings.warn(f"skipping checkpoint: {problem}", stacklevel=2)
    return None


def resolve_checkpoint(path: str) -> list[str]:
    """Candidate checkpoint directories for ``path``, best first (any rank).

    ``path`` is a checkpoint directory itself (one candidate) or a root holding ``step_*``
    directories (complete ones, newest first). Raises CheckpointError when there is nothing."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if os.path.exists(os.path.join(path, META_FILE)) or os.path.exists(os.path.join(path, MARKER_FILE)):
        problem = validate_checkpoint_dir(path)
        if problem:
            raise CheckpointError(problem)
        return [path]
    steps = list_checkpoints(path)
    good = []
    for _, p in reversed(steps):
        problem = validate_checkpoint_dir(p)
        if problem is None:
            good.append(p)
        else:
            warnings.warn(f"skipping checkpoint: {problem}", stacklevel=2)
    if not good:
        what = "no complete step_* checkpoint" if steps else "no checkpoint"
        raise CheckpointError(f"{what} in {path}")
    return good


# --------------------------------------------------------------------------------------------
# RNG state of one rank
# --------------------------------------------------------------------------------------------
def capture_rng_state() -> dict:
    """This rank's RNG states: python, numpy, torch CPU (and CUDA), Megatron's tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = dict(
        python=random.getstate(),
        numpy=np.random.get_state(),
        torch=torch.get_rng_state(),
        tracker={k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    )
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


# --------------------------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------------------------
def _model_sharded_state_dict(model):
    return unwrap(model).sharded_state_dict(metadata=dict(_SHARDING_METADATA))


@contextmanager
def _write_failures_named(final_dir: str):
    """A failed write (torch DCP's ``CheckpointException``, a BaseException raised on every rank;
    the writing rank's cause only on the coordinator) as a CheckpointError naming the checkpoint and
    each failing rank's cause (disk full, permissions, ...)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        causes = "; ".join(f"rank {r}: {exc}" for r, (exc, _) in sorted(e.failures.items()))
        raise CheckpointError(
            f"writing checkpoint {final_dir} failed: {causes or 'on another rank (rank 0 reports the cause)'}"
        ) from None


def write_checkpoint_dir(
    final_dir: str,
    step: int,
    model,
    optimizer=None,
    scheduler=None,
    extra_state: dict | None = None,
    hf_assets_dir: str | None = None,
    save_rng: bool = True,
) -> str:
    """Write one complete checkpoint at ``final_dir`` atomically (collective). Returns its path.

    ``model`` is this rank's GPTModel (or a DDP wrapper of it) carrying ``hf_config``;
    ``optimizer`` a Megatron optimizer; ``scheduler`` anything with ``state_dict()``;
    ``extra_state`` a picklable dict (rank 0's is kept); ``hf_assets_dir`` an HF directory whose
    tokenizer files and generation_config.json are copied along. The tensors are written by this
    process from their own memory (``checkpoint.writer.direct_writes``: no clone, no forked writer,
    no Manager server); where that writer does not apply, Megatron's runs, its processes made to
    die with this one (``runtime.children``)."""
    from megatron.core import dist_checkpointing

    from gspo_megatron.runtime.children import adopt_checkpoint_writers

    final_dir = os.path.abspath(final_dir)
    parent = os.path.dirname(final_dir)
    tmp_dir = None
    if rdist.rank() == 0:
        os.makedirs(parent, exist_ok=True)
        tmp_dir = f"{final_dir}.tmp-{uuid.uuid4().hex[:10]}"
        os.makedirs(os.path.join(tmp_dir, DIST_SUBDIR))
        if save_rng:
            os.makedirs(os.path.join(tmp_dir, "rng"))
    tmp_dir = _broadcast(tmp_dir)
    rdist.barrier()

    state = {"model": _model_sharded_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], metadata=dict(_SHARDING_METADATA))
    with direct_writes() as direct, _write_failures_named(final_dir):
        if direct is None:
            adopt_checkpoint_writers()  # Megatron's writer processes die with this one, also on SIGKILL
        dist_checkpointing.save(state, os.path.join(tmp_dir, DIST_SUBDIR))
    if save_rng:
        torch.save(capture_rng_state(), os.path.join(tmp_dir, "rng", f"rank_{rdist.rank():05d}.pt"))
    rdist.barrier()

    if rdist.rank() == 0:
        torch.save(
            {"scheduler": None if scheduler is None else scheduler.state_dict(), "extra_state": extra_state},
            os.path.join(tmp_dir, "trainer_state.pt"),
        )
        copied = _copy_hf_assets(hf_assets_dir, os.path.join(tmp_dir, ASSETS_SUBDIR))
        params = unwrap(model).config.params_dtype
        meta = dict(
            format_version=FORMAT_VERSION,
            step=int(step),
            hf_config=unwrap(model).hf_config,
            layout=current_layout(),
            dtype=dtype_name(params),
            has_optimizer=optimizer is not None,
            has_rng=save_rng,
            hf_assets=copied,
            sharding_metadata=_SHARDING_METADATA,
            lora=getattr(unwrap(model), "lora", None),
            mtp=bool(getattr(unwrap(model).config, "mtp_num_layers", None)),
        )  # model.lora (models/lora.py), or None; mtp: the model holds its MTP layer (models/mtp.py)
        with open(os.path.join(tmp_dir, META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        _fsync_tree(tmp_dir)
        with open(os.path.join(tmp_dir, MARKER_FILE), "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp_dir)
        _replace_dir(tmp_dir, final_dir)
    rdist.barrier()
    return final_dir


def _replace_dir(tmp_dir: str, final_dir: str) -> None:
    """Rename ``tmp_dir`` to ``final_dir`` (rank 0); an existing ``final_dir`` is moved aside first
    and deleted after (a crash in between leaves only ignored ``*.old-*``/``*.tmp-*`` names)."""
    old = None
    if os.path.exists(final_dir):
        old = f"{final_dir}.old-{uuid.uuid4().hex[:10]}"
        os.rename(final_dir, old)
    os.rename(tmp_dir, final_dir)
    fsync_dir(os.path.dirname(final_dir))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _copy_hf_assets(src: str | None, dst: str) -> list[str]:
    if not src:
        return []
    copied = []
    for name in HF_ASSET_FILES:
        path = os.path.join(src, name)
        if os.path.isfile(path):
            os.makedirs(dst, exist_ok=True)
            shutil.copy2(path, os.path.join(dst, name))
            copied.append(name)
    from gspo_megatron.models.carried import CARRIED_FILE, save_carried

    if save_carried(src, dst):  # the published MTP layers, kept unchanged (models/carried.py)
        copied.append(CARRIED_FILE)
    return copied


def save_checkpoint(
    ckpt_root: str,
    step: int,
    model,
    optimizer=None,
    scheduler=None,
    extra_state: dict | None = None,
    keep_last: int = 0,
    hf_assets_dir: str | None = None,
) -> str:
    """Save ``ckpt_root/step_XXXXXX/`` atomically, point ``latest`` at it, and keep only the newest
    ``keep_last`` checkpoints (0: keep all). Collective. Returns the checkpoint path.
    See ``write_checkpoint_dir`` for the arguments."""
    path = write_checkpoint_dir(
        os.path.join(ckpt_root, step_dir_name(step)), step, model, optimizer, scheduler, extra_state, hf_assets_dir
    )
    if rdist.rank() == 0:
        write_atomic(os.path.join(ckpt_root, LATEST_FILE), os.path.basename(path) + "\n")
        _prune(ckpt_root, keep_last, keep=path)
    rdist.barrier()
    return path


def _prune(ckpt_root: str, keep_last: int, keep: str) -> None:
    """Remove stale temporary directories and all but the newest ``keep_last`` checkpoints."""
    for name in os.listdir(ckpt_root):
        if ".tmp-" in name or ".old-" in name:
            full = os.path.join(ckpt_root, name)
            if os.path.isdir(full):
                shutil.rmtree(full, ignore_errors=True)
            elif name.startswith(LATEST_FILE + ".tmp-"):
                os.remove(full)
    if keep_last <= 0:
        return
    complete = [p for _, p in list_checkpoints(ckpt_root) if validate_checkpoint_dir(p) is None]
    for path in complete[:-keep_last]:
        if os.path.abspath(path) != os.path.abspath(keep):
            shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------
def _prime_optimizer_state(optimizer, reset: bool = False) -> None:
    """Give every inner torch Adam an (all-zero) state so Megatron can build the sharded state
    dict it loads into: Megatron's DistributedOptimizer.state_dict asserts one common 'step',
    which a fresh torch optimizer lacks (Megatron does this with a dummy step on TE/apex only).
    ``reset``: replace existing state too (after a failed, partial load)."""
    for torch_opt in _torch_adams(optimizer):
        if len(torch_opt.state) > 0 and not reset:
            continue
        torch_opt.state.clear()
        for group in torch_opt.param_groups:
            for p in group["params"]:
                torch_opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p.data),
                    "exp_avg_sq": torch.zeros_like(p.data),
                }


def _torch_adams(optimizer) -> list:
    """The torch.optim Adam/AdamW instances inside a Megatron (chained) optimizer (CPU path; TE's
    and apex's fused Adam keep their step in the param groups and need none of this)."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            out.append(inner)
    return out


def _fix_adam_steps(optimizer) -> None:
    """After Megatron's DistributedOptimizer.load_state_dict on the torch-Adam path, the per-param
    'step' is not the loaded one (and may be one tensor shared by all params, which Adam then
    increments once per param). Set an independent tensor per param from the loaded group step."""
    for torch_opt in _torch_adams(optimizer):
        for group in torch_opt.param_groups:
            step = group.get("step")
            if step is None:
                continue
            for p in group["params"]:
                if p in torch_opt.state:
                    torch_opt.state[p]["step"] = torch.tensor(float(step), dtype=torch.float32)


def _layout_key(layout: dict) -> tuple:
    return tuple(layout.get(k) for k in ("tp", "pp", "ep", "etp", "cp"))


def _check_compatible(ckpt_dir: str, meta: dict, optimizer) -> None:
    """Raise CheckpointError when the optimizer cannot be resumed from this checkpoint."""
    if optimizer is None:
        return
    here = current_layout()
    if not meta.get("has_optimizer"):
        raise CheckpointError(f"{ckpt_dir} holds no optimizer state (a converted checkpoint?); load the model only")
    if _layout_key(meta["layout"]) != _layout_key(here):
        raise CheckpointError(
            f"{ckpt_dir} was written with layout {meta['layout']}; the optimizer state can only "
            f"be resumed in that layout (this run: {here}); load the model only"
        )


def _load_model_state(model, state: dict) -> None:
    """``model.load_state_dict(state)``, strict but for Transformer Engine's ``_extra_state`` (FP8
    metadata) that megatron-core leaves out of a module's sharded state dict: TEDotProductAttention's
    ``sharded_state_dict`` holds only its learnable softmax offset, while TE's module still reports
    ``core_attention._extra_state`` (megatron-core 0.16.1 extensions/transformer_engine.py). Such a
    module keeps the extra state it has (Megatron-LM's loader falls back to strict=False for it)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state") or k in state]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint model state: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")


def _load_one(ckpt_dir: str, model, optimizer, scheduler, restore_rng: bool, retry: bool = False) -> tuple[int, Any]:
    from megatron.core import dist_checkpointing

    meta = read_meta(ckpt_dir)
    here = current_layout()
    md = dict(meta.get("sharding_metadata") or _SHARDING_METADATA)
    state = {"model": unwrap(model).sharded_state_dict(metadata=md)}
    merge_swiglu_in_place(state["model"])  # fc1 halves are read into the parameter: no cat + copy back
    if optimizer is not None:
        _prime_optimizer_state(optimizer, reset=retry)
        state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True, metadata=md)
    with direct_reads():  # each item read into its tensor (no buffer + torch.load + copy_)
        loaded = dist_checkpointing.load(state, os.path.join(ckpt_dir, DIST_SUBDIR), strict="assume_ok_unexpected")
    _load_model_state(unwrap(model), loaded["model"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        _fix_adam_steps(optimizer)
    trainer_path = os.path.join(ckpt_dir, "trainer_state.pt")
    trainer = torch.load(trainer_path, weights_only=False) if os.path.exists(trainer_path) else {}
    if scheduler is not None and trainer.get("scheduler") is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    if restore_rng:
        rng_path = os.path.join(ckpt_dir, "rng", f"rank_{rdist.rank():05d}.pt")
        if meta["layout"] == here and os.path.exists(rng_path):
            restore_rng_state(torch.load(rng_path, weights_only=False))
        elif meta.get("has_rng"):
            warnings.warn(
                f"{ckpt_dir}: RNG states not restored (written with layout {meta['layout']}, running {here})",
                stacklevel=3,
            )
    return int(meta["step"]), trainer.get("extra_state")


def load_checkpoint(
    ckpt_root_or_dir: str, model, optimizer=None, scheduler=None, restore_rng: bool = True
) -> tuple[int, Any] | None:
    """Load the newest loadable checkpoint (collective). Returns (step, extra_state), or None
    when ``ckpt_root_or_dir`` holds no checkpoint at all.

    The model part reshards to this run's layout. With ``optimizer`` (and ``scheduler``) the run
    resumes: same layout required, and this rank's RNG states are restored. A checkpoint that
    fails to load falls back to the previous complete one with a warning; an explicitly named
    checkpoint directory that fails raises CheckpointError. For a model-only load into an
    existing bf16/fp16 optimizer, call ``optimizer.reload_model_params()`` afterwards."""
    is_root = not (
        os.path.exists(os.path.join(ckpt_root_or_dir, META_FILE))
        or os.path.exists(os.path.join(ckpt_root_or_dir, MARKER_FILE))
    )
    if is_root and not list_checkpoints(ckpt_root_or_dir):
        return None
    candidates = _broadcast(resolve_checkpoint(ckpt_root_or_dir) if rdist.rank() == 0 else None)
    last_error = None
    for path in candidates:
        _check_compatible(path, read_meta(path), optimizer)  # same answer on every rank
        error = None
        try:
            result = _load_one(path, model, optimizer, scheduler, restore_rng, retry=path != candidates[0])
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - torch DCP's CheckpointException is a BaseException
            error, result = (f"{type(e).__name__}: {e}".strip().splitlines() or ["?"])[0], None
        if _all_ok(error is None):
            if path != candidates[0] and rdist.rank() == 0:
                log.warning("loaded %s instead of the newer %s", path, candidates[0])
            return result
        last_error = error or "failed on another rank"
        if not is_root:
            raise CheckpointError(f"cannot load checkpoint {path}: {last_error}")
        warnings.warn(f"checkpoint {path} failed to load ({last_error}); falling back to an older one", stacklevel=2)
    raise CheckpointError(f"no loadable checkpoint in {ckpt_root_or_dir} (last error: {last_error})")
