"""Rank function for tests/train/test_offload.py (module level: spawned ranks import it)."""

from __future__ import annotations

import torch

# (model dtype, distributed optimizer): fp32 and bf16 with the distributed optimizer (DP-sharded
# fp32 main params / Adam states), and bf16 with Megatron's plain mixed-precision optimizer (each
# param in its own storage, fp32 main params cloned).
VARIANTS = [("float32", True), ("bfloat16", True), ("bfloat16", False)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so -0.0 != 0.0 and NaN payloads count)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def _inner(optimizer):
    from gspo_megatron.trainer.offload import _inner_optimizers

    return list(_inner_optimizers(optimizer))


def _snapshot(ddp, optimizer) -> dict:
    """Every piece of training state by a stable name, as bytes."""
    out = {}
    for i, buf in enumerate(list(ddp.buffers) + list(ddp.expert_parallel_buffers)):
        if buf.param_data is not None:
            out[f"buffer{i}.param_data"] = _bits(buf.param_data)
        out[f"buffer{i}.grad_data"] = _bits(buf.grad_data)
    for name, p in ddp.named_parameters():
        out[f"param:{name}"] = _bits(p)
        out[f"main_grad:{name}"] = _bits(p.main_grad)
    for k, opt in enumerate(_inner(optimizer)):
        for g, group in enumerate(opt.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"opt{k}.group{g}.main_param{j}"] = _bits(p)
                for key, v in opt.state.get(p, {}).items():
                    out[f"opt{k}.group{g}.state{j}.{key}"] = _bits(v) if isinstance(v, torch.Tensor) else v
    return out


def _aliases(ddp) -> bool:
    """Every param.main_grad is still a view of its buffer's grad_data (and param.data of param_data)."""
    for buf in list(ddp.buffers) + list(ddp.expert_parallel_buffers):
        gptr = buf.grad_data.untyped_storage().data_ptr()
        pptr = buf.param_data.untyped_storage().data_ptr() if buf.param_data is not None else None
        for p in buf.params:
            if p.main_grad.untyped_storage().data_ptr() != gptr:
                return False
            if pptr is not None and p.untyped_storage().data_ptr() != pptr:
                return False
    return True


def offload_roundtrip(rank: int, world: int, hf_dir: str) -> dict:
    """For each variant: two real optimizer steps (pseudo-gradients), fresh non-zero grads, then
    offload / reload twice. Returns per variant: the state compared bytewise after each reload, the
    device bytes left while offloaded, the aliasing of views, and the weights after one more step
    taken with and without an offload in between (from the same state)."""
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed
    from gspo_megatron.trainer.offload import TrainStateOffloader
    from gspo_megatron.trainer.optimizer import OptimOptions, optimizer_step, setup_training, zero_grads

    init_distributed(ParallelLayout(ep=2), seed=5)
    results = {}
    for dtype, dist_opt in VARIANTS:
        model = build_model(load_hf_config(hf_dir), ep=2, opts=ModelOptions(dtype=dtype))
        load_hf_weights(model, hf_dir)
        ddp, opt, sched = setup_training(
            model, OptimOptions(lr=1e-2, total_steps=10, use_distributed_optimizer=dist_opt)
        )

        def step(seed: int) -> None:
            zero_grads(ddp, opt)
            g = torch.Generator().manual_seed(seed + rank)
            for p in ddp.parameters():
                p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=g) * 0.1)
            assert optimizer_step(opt, sched)[0]

        predicted = TrainStateOffloader(ddp, opt).expected_bytes()  # before the optimizer has state
        step(1)
        step(2)
        g = torch.Generator().manual_seed(100 + rank)
        for p in ddp.parameters():  # grads present at offload time must come back too
            p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=g))
        before = _snapshot(ddp, opt)
        off = TrainStateOffloader(ddp, opt, chunk_bytes=1 << 14)  # small chunks: storages span several
        res = {"equal": [], "left_bytes": [], "moved": [], "aliases": [], "predicted": predicted}
        for _ in range(2):  # the second round reuses the host buffers
            storages = list(off.storages())
            res["moved"].append(off.offload())
            res["left_bytes"].append(sum(s.nbytes() for s in storages))
            # scribble over the freed memory (an allocator may hand the same blocks out again)
            junk = [torch.full((n,), 0x5A, dtype=torch.uint8) for _, n, _ in off._moved]
            del junk
            res["freed"] = {
                "param_data": all(
                    b.param_data is None or b.param_data.untyped_storage().nbytes() == 0 for b in ddp.buffers
                ),
                "grad_data": all(
                    b.grad_data.untyped_storage().nbytes() == 0
                    for b in list(ddp.buffers) + list(ddp.expert_parallel_buffers)
                ),
                "params": all(p.untyped_storage().nbytes() == 0 for p in ddp.parameters()),
                "optimizer": all(
                    v.untyped_storage().nbytes() == 0
                    for o in _inner(opt)
                    for st in o.state.values()
                    for v in st.values()
                    if isinstance(v, torch.Tensor)
                ),
                "main_params": all(
                    p.untyped_storage().nbytes() == 0
                    for o in _inner(opt)
                    for grp in o.param_groups
                    for p in grp["params"]
                ),
            }
            try:
                off.offload()
                res["double_offload_refused"] = False
            except RuntimeError:
                res["double_offload_refused"] = True
            off.reload()
            after = _snapshot(ddp, opt)
            res["equal"].append(
                sorted(before) == sorted(after)
                and all(
                    torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor) else before[k] == after[k]
                    for k in before
                )
            )
            res["aliases"].append(_aliases(ddp))
        res["n_state_keys"] = sum(1 for k in before if ".state" in k)
        res["state_kinds"] = sorted({k.rsplit(".", 1)[1] for k in before if ".state" in k})
        res["dtypes"] = sorted({str(p.dtype) for p in ddp.parameters()})
        # one more step from this state, with an offload in between: same weights as without
        ref_state = {k: v.clone() for k, v in _snapshot(ddp, opt).items() if isinstance(v, torch.Tensor)}
        off.offload()
        off.reload()
        step(3)
        res["after_step_with_offload"] = {k: v for k, v in _snapshot(ddp, opt).items() if k.startswith("param:")}
        # restore the exact pre-step state into the same objects, step again without offloading
        for name, p in ddp.named_parameters():
            p.data.view(-1).view(torch.uint8).copy_(ref_state[f"param:{name}"])
        for k, o in enumerate(_inner(opt)):
            for gi, grp in enumerate(o.param_groups):
                for j, p in enumerate(grp["params"]):
                    p.data.view(-1).view(torch.uint8).copy_(ref_state[f"opt{k}.group{gi}.main_param{j}"])
                    for key, v in o.state.get(p, {}).items():
                        if isinstance(v, torch.Tensor):
                            v.view(-1).view(torch.uint8).copy_(ref_state[f"opt{k}.group{gi}.state{j}.{key}"])
        sched.num_steps -= 1
        step(3)
        res["after_step_without"] = {k: v for k, v in _snapshot(ddp, opt).items() if k.startswith("param:")}
        results[f"{dtype}/{'distopt' if dist_opt else 'plain'}"] = res
    return results
