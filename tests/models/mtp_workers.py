"""Rank functions of tests/models/test_mtp_model.py (module level: spawned ranks import them).

:func:`layout_run` builds, in one parallel layout, the Megatron model of a tiny checkpoint twice from the
same HF weights: without its MTP layer and with it (``ModelOptions.mtp``). On each model, for each batch
(right-padded rows; packed sequences), it runs one forward-backward through megatron's own schedule
(1F1B with PP > 1) with ``lm_forward(..., fused=True)``; the MTP model is asked for its drafts, and its
loss adds a loss on them:

    loss = sum(hidden W^T * R) + [MTP model] sum_k sum(d_k W.detach()^T * R')

(W the output weight shard [V/tp, H], R / R' fixed random [b, s, V] sliced to the shard). It returns every
parameter's gradient by global name, the main hidden states and the drafts (last stage), and from the MTP
model the HF export (``convert.export_to_hf_dir``), the names of the weight-sync stream
(``export_hf_weights``) and a Megatron checkpoint read back in TP1 by the conversion tool's path
(``convert.megatron_to_hf``)."""

from __future__ import annotations

from distributed_harness import fresh_process


def _schedule(model, batch: dict, mtp: bool, vocab: int) -> dict:
    """One forward-backward of ``batch`` (module docstring); returns {"grads", "hidden", "drafts"}."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.models.lm_head import lm_forward, mtp_output_weight
    from gspo_megatron.models.param_names import global_names

    tokens = batch["tokens"]
    b, s = tokens.shape
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    shard = vocab // tp
    lo = tp_rank * shard
    r_main = torch.randn(b, s, vocab, generator=torch.Generator().manual_seed(11))[..., lo : lo + shard]
    r_mtp = torch.randn(b, s, vocab, generator=torch.Generator().manual_seed(12))[..., lo : lo + shard]
    psp = None
    if batch.get("cu") is not None:  # the trainer's own THD parameters (trainer/packing.py)
        from gspo_megatron.trainer.packing import packed_seq_params

        cu = batch["cu"]
        psp = packed_seq_params({"cu_seqlens": cu, "max_seqlen": int((cu[1:] - cu[:-1]).max())})
    seen: dict = {}

    def forward_step(data_iterator, model_):
        item = next(data_iterator)
        drafts: list | None = [] if mtp else None
        output, weight = lm_forward(
            model_,
            item["tokens"],
            item["position_ids"],
            fused=True,
            attention_mask=None,
            packed_seq_params=psp,
            drafts=drafts,
        )

        def loss_func(hidden):
            loss = ((hidden @ weight.t()) * r_main).sum()
            seen["hidden"] = hidden.detach().clone()
            if drafts:
                w = mtp_output_weight(model_)
                seen["drafts"] = [d.detach().clone() for d in drafts]
                loss = loss + sum(((d @ w.t()) * r_mtp).sum() for d in drafts)
            return loss, {}

        return output, loss_func

    model.zero_grad(set_to_none=True)
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([batch]),
        model=[model],
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=False,
    )
    names = global_names(model)
    grads = {names[n]: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return {"grads": grads, "hidden": seen.get("hidden"), "drafts": seen.get("drafts")}


def layout_run(rank: int, world: int, hf_dir: str, root: str, layout: dict, batches: list[dict]) -> dict:
    """Module docstring. ``layout``: {"tp", "pp", "ep", "etp"} (each 1 / None when absent). Returns per
    rank {"plain": [per batch], "mtp": [per batch], "unasked": [per batch: the MTP model without drafts],
    "unasked_mtp_runs", "last": last pipeline stage, "tp_rank"}, and on rank 0
    "streamed" (the weight-sync stream's HF names); the exports are written under ``root``."""
    from megatron.core import parallel_state as ps

    from gspo_megatron import convert
    from gspo_megatron.checkpoint.manager import write_checkpoint_dir
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import export_hf_weights, load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    tp, pp, ep, etp = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1), layout.get("etp")
    init_distributed(ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1), seed=0)
    hf = load_hf_config(hf_dir)
    out: dict = {"last": ps.is_pipeline_last_stage(), "tp_rank": ps.get_tensor_model_parallel_rank()}
    vocab = int(hf["vocab_size"])
    for mtp in (False, True):
        opts = ModelOptions(transformer_impl="local", dtype="float32", mtp=mtp)
        model = build_model(hf, tp, pp, ep, etp, opts=opts)
        load_hf_weights(model, hf_dir)
        out["mtp" if mtp else "plain"] = [_schedule(model, b, mtp, vocab) for b in batches]
        if mtp:
            runs = []  # the MTP model not asked for drafts: its MTP block must not run
            hook = model.mtp.register_forward_hook(lambda *_: runs.append(1)) if model.mtp_process else None
            out["unasked"] = [_schedule(model, b, False, vocab) for b in batches]
            out["unasked_mtp_runs"] = len(runs)
            if hook is not None:
                hook.remove()
            convert.export_to_hf_dir(model, hf, f"{root}/final", 5 * 10**9, assets_dir=hf_dir)
            streamed = [n for bucket in export_hf_weights(model, 1 << 20) for n, _ in bucket or []]
            if rank == 0:
                out["streamed"] = streamed
            write_checkpoint_dir(f"{root}/ckpt", 0, model, hf_assets_dir=hf_dir, save_rng=False)
    init_distributed(ParallelLayout())  # read the checkpoint back in TP1 (data parallel over the ranks)
    convert.megatron_to_hf(f"{root}/ckpt", f"{root}/export")
    destroy_distributed()
    return out


def build_refused(rank: int, world: int, hf: dict, layout: dict) -> str:
    """The one-line ValueError of ``build_model(hf, ..., ModelOptions(mtp=True))`` in ``layout`` ("" if none)."""
    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(**layout))
    try:
        build_model(hf, layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1), opts=ModelOptions(mtp=True))
    except ValueError as e:
        return str(e)
    finally:
        destroy_distributed()
    return ""


def draft_loss_grads(rank: int, world: int, hf_dir: str, tokens) -> dict:
    """One rank: a loss on the drafts alone (``sum((d_1 W.detach()^T)^2)``), backward, on the MTP model
    built without and with ``model.recompute`` (megatron checkpoints the MTP layer then); returns
    {recompute: {parameter name: gradient or None}}."""
    import torch

    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.lm_head import lm_forward, mtp_output_weight
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(), seed=0)
    hf = load_hf_config(hf_dir)
    out = {}
    b, s = tokens.shape
    for recompute in (False, True):
        opts = ModelOptions(transformer_impl="local", dtype="float32", mtp=True, recompute=recompute)
        model = build_model(hf, opts=opts)
        load_hf_weights(model, hf_dir)
        drafts: list = []
        lm_forward(model, tokens, torch.arange(s).expand(b, s), fused=True, attention_mask=None, drafts=drafts)
        ((drafts[0] @ mtp_output_weight(model).t()) ** 2).sum().backward()
        out[recompute] = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    destroy_distributed()
    return out


@fresh_process  # the TE stand-in is installed before megatron is imported
def te_and_local_drafts(rank: int, world: int, hf_dir: str, tokens) -> dict:
    """One rank, Transformer Engine's layer spec over the CPU stand-in (``te_standin.py``) and the local spec:
    the model of ``hf_dir`` with its MTP layer (``ModelOptions.mtp``), HF weights loaded, one forward of
    ``tokens`` [b, s] asking for the drafts. Returns per spec {"classes": the MTP layer's module classes,
    "drafts": MTP states [b, s, H], "logits": the main output, "export": the MTP layer's exported HF
    tensors}."""
    import te_standin

    te_standin.install()
    te_standin.patch_build()
    import torch

    from gspo_megatron.models.build import ModelOptions, build_model
    from gspo_megatron.models.carried import mtp_names
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.lm_head import lm_forward
    from gspo_megatron.models.weights import export_hf_weights, load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed

    init_distributed(ParallelLayout(), seed=0)
    hf = load_hf_config(hf_dir)
    out = {}
    for impl in ("transformer_engine", "local"):
        model = build_model(hf, opts=ModelOptions(transformer_impl=impl, dtype="float32", mtp=True))
        load_hf_weights(model, hf_dir)
        model.eval()
        drafts: list = []
        b, s = tokens.shape
        with torch.no_grad():
            pos = torch.arange(s).expand(b, s)
            logits, _ = lm_forward(model, tokens, pos, fused=False, drafts=drafts, attention_mask=None)
        streamed = {n: t.clone() for bucket in export_hf_weights(model, 1 << 20) for n, t in bucket or []}
        layer = model.mtp.layers[0]
        out[impl] = {
            "classes": {
                "enorm": type(layer.enorm).__name__,
                "final_layernorm": type(layer.final_layernorm).__name__,
                "eh_proj": type(layer.eh_proj).__name__,
                "self_attention": type(layer.transformer_layer.self_attention).__name__,
                "linear_qkv": type(layer.transformer_layer.self_attention.linear_qkv).__name__,
            },
            "drafts": [d.clone() for d in drafts],
            "logits": logits.clone(),
            "export": {n: streamed[n] for n in mtp_names(hf, streamed)},
        }
    destroy_distributed()
    return out
