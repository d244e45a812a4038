"""Rank functions for tests/models/test_lora_te.py: LoRA on Transformer Engine's layer spec (the TE
stand-in, ``te_standin.py``, installed before megatron is imported) beside LoRA on the local spec.

``lora_spec_layouts(rank, world, jobs, rows, records, overrides)``: for each (kind, hf_dir, runs), each
run an (impl, layout): the base model's log-probs, the LoRA model's with fresh adapters, every
adapter's name and class; then B set to the same random values in every run (``set_random_b``: seeded
by the spec-independent name), the log-probs through the adapters and the merged HF export; one GSPO
training step with the first step's reduced gradients at full size (routed experts named as the local
spec names them); the trained model's log-probs and merged export. Returns {kind: {run name: result}}
on rank 0. ``standin=False`` (the GPU test, tests/gpu/test_lora_te_gpu.py): Transformer Engine's own
modules."""

from __future__ import annotations

from conversion_workers import layout_name
from distributed_harness import fresh_process


def run_name(impl: str, layout: dict) -> str:
    return f"{'te' if impl == 'transformer_engine' else 'local'}-{layout_name(layout)}"


def _export(model) -> dict:
    from gspo_megatron.models.weights import export_hf_weights

    out = {}
    for bucket in export_hf_weights(model, bucket_bytes=1 << 20):
        if bucket is not None:
            out.update({n: t.detach().clone() for n, t in bucket})
    return out


@fresh_process  # the TE stand-in is installed before megatron is imported
def lora_spec_layouts(
    rank: int, world: int, jobs: list, rows: list, records: list, overrides: list[str], standin: bool = True
) -> dict:
    if standin:  # CPU: the stand-in; a GPU with Transformer Engine runs TE's own modules
        import te_standin

        te_standin.install()
        te_standin.patch_build()
    from gspo_megatron import factory
    from gspo_megatron.config import load_config
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.lora import lora_modules
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.score import score_rows
    from lora_workers import set_random_b
    from uneven_expert_workers import train_capturing

    out: dict = {}
    for kind, hf_dir, runs in jobs:
        hf = load_hf_config(hf_dir)
        for impl, layout in runs:
            lay = [f"parallel.{k}={v}" for k, v in layout.items()]
            cfg = load_config(None, [*overrides, f"model.transformer_impl={impl}", *lay])
            p = cfg.parallel
            init_distributed(ParallelLayout(p.tp, p.pp, p.ep, p.etp, p.cp, bool(p.sequence_parallel)), seed=cfg.seed)
            base_cfg = load_config(None, [*overrides, f"model.transformer_impl={impl}", "model.lora.rank=0", *lay])
            base = factory.build_model(base_cfg, hf)
            load_hf_weights(base, hf_dir)
            base_lps = score_rows(base, rows, micro_batch_size=3)
            del base
            model = factory.build_model(cfg, hf)
            load_hf_weights(model, hf_dir)
            fresh_lps = score_rows(model, rows, micro_batch_size=3)
            adapters = {n: type(getattr(m, "module", m)).__name__ for n, m in lora_modules(model)}
            trainable = sorted(n for n, q in model.named_parameters() if q.requires_grad)
            set_random_b(model)
            b_lps = score_rows(model, rows, micro_batch_size=3)
            b_packed = score_rows(model, rows, micro_batch_size=3, max_tokens_per_micro_batch=64)
            b_export = _export(model)
            _, metrics, grads = train_capturing(cfg, model, records)
            trained_lps = score_rows(model, rows, micro_batch_size=3)
            trained_export = _export(model)
            if rank == 0:
                out.setdefault(kind, {})[run_name(impl, layout)] = dict(
                    base=base_lps,
                    fresh=fresh_lps,
                    adapters=adapters,
                    trainable=trainable,
                    b=b_lps,
                    b_packed=b_packed,
                    b_export=b_export,
                    grads=grads,
                    metrics=metrics,
                    trained=trained_lps,
                    trained_export=trained_export,
                )
            model = None
    destroy_distributed()
    return out if rank == 0 else {}
