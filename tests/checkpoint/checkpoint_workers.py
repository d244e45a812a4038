"""Rank functions for the checkpoint tests (module level: spawned ranks import them)."""

from __future__ import annotations

import os
import random
import warnings

import numpy as np
import torch


def _setup(hf_dir: str, layout: dict):
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.trainer.optimizer import OptimOptions, setup_training

    init_distributed(ParallelLayout(**layout), seed=5)
    model = build_model(load_hf_config(hf_dir), opts=ModelOptions(), **layout)
    load_hf_weights(model, hf_dir)
    ddp, opt, sched = setup_training(
        model, OptimOptions(lr=1e-2, lr_warmup_steps=3, total_steps=10, lr_decay_style="cosine")
    )
    return model, ddp, opt, sched


def _fake_step(ddp, opt, sched, seed: int) -> None:
    """One optimizer step with deterministic pseudo-gradients (same on every layout rank)."""
    from gspo_megatron.trainer.optimizer import optimizer_step, zero_grads

    zero_grads(ddp, opt)
    g = torch.Generator().manual_seed(seed)
    for p in ddp.parameters():
        p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=g) * 0.1)
    applied, _ = optimizer_step(opt, sched)
    assert applied


def _weights(model) -> dict:
    from gspo_megatron.models.weights import export_hf_weights

    out = {}
    for bucket in export_hf_weights(model):
        if bucket is not None:
            out.update({n: t.clone() for n, t in bucket})
    return out


def _draws() -> dict:
    """One draw from each RNG a resumed run must continue identically."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(3)
    return dict(python=random.random(), numpy=float(np.random.rand()), torch=torch.rand(3), tracker=tracked)


def resume_job(rank: int, world: int, hf_dir: str, root: str, layout: dict, other_layout: dict) -> dict:
    """Train, checkpoint, continue; then resume from the checkpoint in a fresh model/optimizer and
    continue the same way. Also: keep_last pruning, fallback from a corrupt newest checkpoint,
    model-only load into another layout, and refusal to resume the optimizer in another layout."""
    from gspo_megatron.checkpoint import manager as ck
    from gspo_megatron.runtime.distributed import destroy_distributed

    res = {}
    model, ddp, opt, sched = _setup(hf_dir, layout)
    _fake_step(ddp, opt, sched, seed=1)
    ck.save_checkpoint(root, 1, ddp, opt, sched, extra_state={"data_position": 17}, keep_last=2)
    draws_after_save = _draws()
    _fake_step(ddp, opt, sched, seed=2)
    expected = _weights(model)
    expected_lr = opt.param_groups[0]["lr"]

    # a fresh model (weights from HF again, fresh optimizer) resumes from step 1
    model2, ddp2, opt2, sched2 = _setup(hf_dir, layout)
    step, extra = ck.load_checkpoint(root, ddp2, opt2, sched2)
    res["resumed"] = (step, extra)
    draws_after_load = _draws()
    res["rng_equal"] = all(
        torch.equal(torch.as_tensor(draws_after_save[k]), torch.as_tensor(draws_after_load[k]))
        for k in draws_after_save
    )
    _fake_step(ddp2, opt2, sched2, seed=2)
    got = _weights(model2)
    res["lr_equal"] = opt2.param_groups[0]["lr"] == expected_lr
    if rank == 0:
        res["weights_equal"] = sorted(got) == sorted(expected) and all(
            torch.equal(got[k], expected[k]) for k in expected
        )

    # more checkpoints: keep_last=2 keeps steps 2 and 3
    ck.save_checkpoint(root, 2, ddp2, opt2, sched2, extra_state={"data_position": 18}, keep_last=2)
    weights_at_2 = _weights(model2)
    _fake_step(ddp2, opt2, sched2, seed=3)
    ck.save_checkpoint(root, 3, ddp2, opt2, sched2, extra_state={"data_position": 19}, keep_last=2)
    res["after_prune"] = [s for s, _ in ck.list_checkpoints(root)]
    res["latest_pointer"] = open(os.path.join(root, ck.LATEST_FILE)).read().strip()

    # corrupt the newest checkpoint's tensor data: loading falls back to step 2 with a warning
    torch.distributed.barrier()
    if rank == 0:
        dist_dir = os.path.join(root, "step_000003", ck.DIST_SUBDIR)
        for name in os.listdir(dist_dir):
            if name.endswith(".distcp"):
                with open(os.path.join(dist_dir, name), "r+b") as f:
                    f.truncate(16)
    torch.distributed.barrier()
    model3, ddp3, opt3, sched3 = _setup(hf_dir, layout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res["fallback"] = ck.load_checkpoint(root, ddp3, opt3, sched3)
    res["fallback_warned"] = any("falling back" in str(w.message) for w in caught)
    w3 = _weights(model3)
    if rank == 0:
        res["fallback_weights_equal"] = all(torch.equal(w3[k], weights_at_2[k]) for k in weights_at_2)

    # a different layout: the optimizer cannot resume, the model reshards
    model4, ddp4, opt4, sched4 = _setup(hf_dir, other_layout)
    try:
        ck.load_checkpoint(os.path.join(root, "step_000002"), ddp4, opt4, sched4)
        res["other_layout_optimizer"] = "loaded"
    except ck.CheckpointError as e:
        res["other_layout_optimizer"] = str(e)
    res["other_layout_model"] = ck.load_checkpoint(os.path.join(root, "step_000002"), model4)
    w4 = _weights(model4)
    if rank == 0:
        res["other_layout_weights_equal"] = all(torch.equal(w4[k], weights_at_2[k]) for k in weights_at_2)

    # export a training checkpoint root to HF (newest loadable step: 2), in this other layout
    from gspo_megatron.convert import megatron_to_hf

    out = os.path.join(os.path.dirname(root), "exported")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        files = megatron_to_hf(root, out, **other_layout)
    if rank == 0:
        from safetensors.torch import load_file

        exported = load_file(os.path.join(out, files[0]))
        res["export_root_equal"] = (
            len(files) == 1
            and sorted(exported) == sorted(weights_at_2)
            and all(torch.equal(exported[k], weights_at_2[k]) for k in weights_at_2)
        )
    destroy_distributed()
    return res


def in_place_merge_job(rank: int, world: int, hf_dir: str, ckpt: str) -> dict:
    """Convert HF -> Megatron, then load into a model holding other weights: the gated fc1 halves are
    read into the parameter itself (Megatron's swiglu merge replaced) and every weight comes back.
    Also: the replaced merge falls back to Megatron's cat for halves that are not the parameter."""
    from gspo_megatron import convert
    from gspo_megatron.checkpoint.in_place_reads import merge_swiglu_in_place
    from gspo_megatron.checkpoint.manager import load_checkpoint, unwrap
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    init_distributed(ParallelLayout(), seed=5)
    convert.hf_to_megatron(hf_dir, ckpt)
    model = convert.build_empty_model(load_hf_config(hf_dir), 1, 1, 1, None, 1, "float32")
    for p in model.parameters():
        torch.nn.init.normal_(p)
    factories = unwrap(model).sharded_state_dict()
    changed = merge_swiglu_in_place(factories)
    fc1 = [v for k, v in factories.items() if k.endswith("linear_fc1.weight")]
    halves = [t.clone() for t in fc1[0].data.chunk(2)]
    fallback = fc1[0].merge_fn(halves)  # copies, not views of the parameter: Megatron's torch.cat
    fallback_ok = fallback.data_ptr() != fc1[0].data.data_ptr() and torch.equal(fallback, fc1[0].data)
    import gspo_megatron.checkpoint.in_place_reads as in_place

    seen, check = [], in_place._halves_are_data
    in_place._halves_are_data = lambda parts, data: seen.append(check(parts, data)) or seen[-1]
    load_checkpoint(ckpt, model, restore_rng=False)  # its own sharded state dict, merges replaced
    in_place._halves_are_data = check
    from gspo_megatron.models.weights import load_hf_weights

    ref = convert.build_empty_model(load_hf_config(hf_dir), 1, 1, 1, None, 1, "float32")
    load_hf_weights(ref, hf_dir)
    mine, want = dict(unwrap(model).named_parameters()), dict(unwrap(ref).named_parameters())
    return dict(
        changed=changed,
        fc1=len(fc1),
        fallback_ok=fallback_ok,
        in_place=seen,
        equal=sorted(mine) == sorted(want) and all(torch.equal(mine[k], want[k]) for k in want),
    )


def reinit_groups_job(rank: int, world: int, layouts: list[dict]) -> list[int]:
    """torch.distributed's registered process groups after each re-initialization of Megatron's
    parallel state in one process: the previous layout's groups must be gone, not piled up."""
    from torch.distributed import distributed_c10d as c10d

    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    counts = []
    for layout in layouts:
        init_distributed(ParallelLayout(**layout))
        counts.append(len(c10d._world.pg_map))
    return counts


def direct_reads_job(rank: int, world: int, hf_dir: str, ckpt: str, save_tp: int, load_tp: int) -> dict:
    """Convert HF -> Megatron with tp=save_tp (every rank), then load it with tp=load_tp twice: through
    the direct reader (items read straight into the parameters) and through torch DCP's own reader
    (``direct_reads`` made a no-op). Returns this rank's parameters both ways and the reader's counts."""
    import contextlib

    import gspo_megatron.checkpoint.in_place_reads as in_place
    import gspo_megatron.checkpoint.manager as checkpoint
    from gspo_megatron import convert
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    init_distributed(ParallelLayout(tp=save_tp, ep=world // save_tp), seed=5)
    convert.hf_to_megatron(hf_dir, ckpt, tp=save_tp, ep=world // save_tp)
    init_distributed(ParallelLayout(tp=load_tp, ep=world // load_tp), seed=5)
    made, make = [], in_place.direct_reader_class
    in_place.direct_reader_class = lambda: made.append(make()) or made[-1]
    direct, _ = convert.load_model(ckpt, tp=load_tp, ep=world // load_tp)
    in_place.direct_reader_class = make
    checkpoint.direct_reads = contextlib.nullcontext
    plain, _ = convert.load_model(ckpt, tp=load_tp, ep=world // load_tp)
    return dict(
        direct_items=sum(c.direct_items for c in made),
        base_tensor_items=sum(c.base_tensor_items for c in made),
        readers=len(made),
        a=_params(direct),
        b=_params(plain),
    )


def _params(model) -> dict:
    from gspo_megatron.checkpoint.manager import unwrap

    return {k: v.detach().clone() for k, v in unwrap(model).named_parameters()}


def _storage_layout(ckpt: str) -> dict:
    import pickle

    from gspo_megatron.checkpoint.manager import DIST_SUBDIR

    with open(os.path.join(ckpt, DIST_SUBDIR, ".metadata"), "rb") as f:
        md = pickle.load(f)
    return {(k.fqn, k.offset, k.index): (v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}


def direct_writes_job(rank: int, world: int, hf_dir: str, root: str, tp: int) -> dict:
    """Save one model (HF weights, tp x ep layout) twice: through ``dist_ckpt_writer`` (the default)
    and through Megatron's own writer (``direct_writes`` made to yield None); counting the processes
    forked and whether Megatron's Manager queue was created during each. Then load each checkpoint
    with the direct reader and with torch DCP's reader into a fresh model. Returns this rank's
    parameters (original and the four loads), the counts and rank 0's storage layouts."""
    import contextlib

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    import gspo_megatron.checkpoint.manager as checkpoint
    import gspo_megatron.checkpoint.writer as writer
    from gspo_megatron import convert
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    layout = dict(tp=tp, ep=world // tp)
    init_distributed(ParallelLayout(**layout), seed=5)
    model, _ = convert.load_model(hf_dir, **layout)
    forks = []
    os.register_at_fork(before=lambda: forks.append(1))
    made, make = [], writer.direct_writer_class
    writer.direct_writer_class = lambda: made.append(make()) or made[-1]
    direct = checkpoint.write_checkpoint_dir(os.path.join(root, "direct"), 0, model, save_rng=False)
    out = dict(
        direct_forks=len(forks),
        direct_manager=fa._results_queue is not None,
        files_written=sum(c.files_written for c in made),
    )
    checkpoint.direct_writes = lambda: contextlib.nullcontext(None)
    mcore = checkpoint.write_checkpoint_dir(os.path.join(root, "mcore"), 0, model, save_rng=False)
    out.update(
        mcore_forks=len(forks) - out["direct_forks"],
        mcore_manager=fa._results_queue is not None,
        original=_params(model),
    )
    if rank == 0:
        out.update(
            direct_layout=_storage_layout(direct),
            mcore_layout=_storage_layout(mcore),
            direct_files=sorted(os.listdir(os.path.join(direct, checkpoint.DIST_SUBDIR))),
            mcore_files=sorted(os.listdir(os.path.join(mcore, checkpoint.DIST_SUBDIR))),
        )
    for name, ckpt in (("direct", direct), ("mcore", mcore)):
        out[f"{name}_read_direct"] = _params(convert.load_model(ckpt, **layout)[0])
        with contextlib.ExitStack() as stack:
            stack.callback(setattr, checkpoint, "direct_reads", checkpoint.direct_reads)
            checkpoint.direct_reads = contextlib.nullcontext
            out[f"{name}_read_dcp"] = _params(convert.load_model(ckpt, **layout)[0])
    return out


def failed_write_job(rank: int, world: int, hf_dir: str, root: str) -> dict:
    """A save whose file write fails (OSError in one bucket): what the caller sees and what is left."""
    import gspo_megatron.checkpoint.manager as checkpoint
    import gspo_megatron.checkpoint.writer as writer
    from gspo_megatron import convert
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    init_distributed(ParallelLayout(), seed=5)
    model, _ = convert.load_model(hf_dir)
    make = writer.direct_writer_class

    def failing():
        class Failing(make()):
            @classmethod
            def write_bucket(cls, transforms, bucket):
                raise OSError(28, "No space left on device", bucket[0])

        return Failing

    writer.direct_writer_class = failing
    try:
        checkpoint.write_checkpoint_dir(os.path.join(root, "step"), 0, model, save_rng=False)
        error = None
    except checkpoint.CheckpointError as e:
        error = str(e)
    return dict(error=error, left=sorted(os.listdir(root)))
