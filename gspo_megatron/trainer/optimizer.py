"""Megatron DDP wrapping, the (distributed) optimizer, the LR schedule, and one optimizer step.

Every rank calls ``setup_training`` once after building its model and ``optimizer_step`` after each
mini-batch's forward-backward pass.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimOptions:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    total_steps: int = 1
    use_distributed_optimizer: bool = True
    grad_reduce_in_fp32: bool = True
    cpu_offload_fraction: float = 0.0
    mtp_lr: float | None = None  # the MTP layer's peak learning rate (model.mtp); None: lr


def mtp_lr_overrides(opt_config, opts: OptimOptions) -> dict | None:
    """megatron's param-group overrides giving the MTP layer (``model.mtp``: ``mtp.layers.*``) its own peak
    learning rate ``opts.mtp_lr`` (and min_lr in the same ratio), on top of megatron's standard ones (no
    weight decay on biases and 1-D parameters); None (megatron's defaults) without ``mtp_lr``. Adam's step
    does not scale with the loss, so ``gspo.mtp_loss_coef`` cannot set how fast the draft follows the
    policy: this does (a separate param group; its learning rate follows the same warmup and decay)."""
    if opts.mtp_lr is None:
        return None
    from megatron.core.optimizer import ParamKey, get_standard_config_overrides

    overrides = get_standard_config_overrides(opt_config)
    min_lr = opts.min_lr * opts.mtp_lr / opts.lr if opts.lr > 0 else opts.min_lr
    overrides[ParamKey(name="*mtp.layers.*")] = {"max_lr": opts.mtp_lr, "min_lr": min_lr}
    return overrides


def setup_training(model, opts: OptimOptions):
    """Wrap ``model`` in Megatron's DDP and build its optimizer and LR scheduler.

    Returns (ddp_model, optimizer, scheduler). Gradient reduction over DP (and CP) happens in
    ``finalize_model_grads`` at the end of the forward-backward schedule (no overlap: simple and
    exact; overlap is a GPU-only speed option)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = model.config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=opts.grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=opts.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # non-finite steps are detected and skipped by the trainer
    )
    ddp = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    config.grad_sync_func = None
    config.param_sync_func = None
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=opts.lr,
        min_lr=opts.min_lr,
        weight_decay=opts.weight_decay,
        adam_beta1=opts.adam_beta1,
        adam_beta2=opts.adam_beta2,
        adam_eps=opts.adam_eps,
        clip_grad=opts.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=opts.use_distributed_optimizer,
        optimizer_cpu_offload=opts.cpu_offload_fraction > 0,
        optimizer_offload_fraction=opts.cpu_offload_fraction,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp], config_overrides=mtp_lr_overrides(opt_config, opts))
    use_expert_tp_group_for_norm(optimizer)
    steps = max(1, opts.total_steps)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=opts.lr if opts.lr_warmup_steps == 0 else 0.0,
        max_lr=opts.lr,
        min_lr=opts.min_lr,
        lr_warmup_steps=opts.lr_warmup_steps,
        lr_decay_steps=max(steps, opts.lr_warmup_steps + 1),
        lr_decay_style=opts.lr_decay_style,
        start_wd=opts.weight_decay,
        end_wd=opts.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler


def use_expert_tp_group_for_norm(optimizer) -> int:
    """Megatron-Core 0.16.1 fix (its bug, GPU and CPU alike): the expert-parallel optimizer skips a
    parameter that is not tensor-parallel split (the experts' ``linear_fc2.bias``) in the grad norm
    unless this rank is rank 0 of the optimizer's ``tp_group``; ``get_megatron_optimizer`` sets that to
    the dense TP group for every sub-optimizer (optimizer/__init__.py), while expert parameters are
    replicated over the expert-TP group. With ETP < TP (gpt_oss needs ETP1 for its expert biases) the
    dense TP rank 1 holds expert shards (distributed optimizer) or whole experts of its own, and their
    bias gradients were dropped from the norm (measured: gpt_oss TP2 x ETP1 grad norm 0.7% low, and a
    clip coefficient that differs per rank without the distributed optimizer). Each expert-parallel
    sub-optimizer gets the expert-TP group instead. Every rank calls it (through ``setup_training``).
    Returns how many sub-optimizers it changed."""
    from megatron.core import parallel_state as ps

    changed = 0
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        if any(g.get("is_expert_parallel", False) for g in sub.param_groups):
            sub.tp_group = ps.get_expert_tensor_parallel_group()
            changed += 1
    return changed


def zero_grads(ddp, optimizer) -> None:
    ddp.zero_grad_buffer()
    optimizer.zero_grad()


def optimizer_step(optimizer, scheduler, increment: int = 1) -> tuple[bool, float | None]:
    """Clip and apply the update unless the global gradient norm is non-finite; then the update is
    skipped on every rank (the norm is all-reduced, so all ranks agree) and the gradients dropped.
    Returns (applied, grad_norm). Every rank calls it.

    Megatron's ``step()`` only checks for inf/NaN with an fp16 loss scaler; in fp32/bf16 it would apply
    a NaN update. So the norm is computed first (``prepare_grads`` is idempotent: it copies the grad
    buffers into the main grads again inside ``step``)."""
    import math

    found_inf = optimizer.prepare_grads()
    if found_inf:
        return False, None
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        optimizer.zero_grad()
        return False, grad_norm
    applied, grad_norm, _ = optimizer.step()
    if applied:
        scheduler.step(increment=increment)
    return bool(applied), (None if grad_norm is None else float(grad_norm))
