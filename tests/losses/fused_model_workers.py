"""Rank function for the fused log-prob head on the real Megatron GPTModel (spawned ranks import it).

``fused_vs_logits(rank, world, overrides, tied)``: builds the trainer's model (tiny MoE, the given
layout, tied or untied embeddings), then on the same micro-batches runs (a) the old-log-prob pass
(``compute_logprobs``) and (b) one forward-backward of the GSPO loss through Megatron's schedule
(``run_schedule``), once with ``fused_logprobs=True`` (hidden states + output weight) and once with
False (GPTModel's logits). Returns, per path: the log-probs (last stage), the loss-function metrics
(last stage) and every parameter's gradient on this rank.
"""

from __future__ import annotations

import torch

from gspo_megatron.sample import Sample


def _records(vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate([(3, 9), (2, 1), (5, 14), (4, 0), (1, 6)]):
        toks = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        out.append(
            Sample.from_tokens(
                toks,
                p,
                advantage=float(torch.randn(1, generator=g)),
                old_logprobs=(torch.randn(r, generator=g) * 0.01 - 3.0).tolist(),
            )
        )
    return out


def fused_vs_logits(rank: int, world: int, overrides: list[str], tied: bool, kernels: str = "auto") -> dict:
    from megatron.core import parallel_state as ps

    from gspo_megatron import factory
    from gspo_megatron.config import load_config
    from gspo_megatron.losses import PolicyLossConfig, make_megatron_loss_func
    from gspo_megatron.models.arch import model_hf_config
    from gspo_megatron.runtime.distributed import ParallelLayout, destroy_distributed, init_distributed
    from gspo_megatron.trainer.micro_batches import (
        collate,
        compute_logprobs,
        run_schedule,
        sequence_multiple,
        to_device,
    )

    cfg = load_config(None, overrides)
    p = cfg.parallel
    init_distributed(ParallelLayout(p.tp, p.pp, p.ep, p.etp, p.cp, bool(p.sequence_parallel)), seed=cfg.seed)
    hf, _ = model_hf_config(cfg)
    hf = dict(hf, tie_word_embeddings=tied)
    model = factory.build_model(cfg, hf)
    vocab = int(hf["vocab_size"])
    records = _records(vocab)
    multiple = sequence_multiple(p.tp, p.cp)
    batches = [to_device(collate(records[i : i + 3], multiple=multiple)) for i in (0, 3)]
    for b in batches:
        b["normalizer"] = 4.0  # sequences with a response token in the whole batch
    lcfg = PolicyLossConfig(mode="gspo", clip_low=0.2, clip_high=0.2, entropy_coef=0.01)
    tp_group = ps.get_tensor_model_parallel_group()
    from gspo_megatron.losses import fused_logprobs, megatron_loss

    forms = set()  # the per-chunk kernels' form the fused head ran in
    pick = fused_logprobs.chunk_ops
    fused_logprobs.chunk_ops = lambda dev, k, dt: forms.add(pick(dev, kernels, dt).form) or pick(dev, kernels, dt)
    calls = []  # which path the loss functions took: the output's last dim (H fused, V/tp not)
    real = megatron_loss.token_logprobs
    megatron_loss.token_logprobs = lambda out_, *a, **k: calls.append(out_.shape[-1]) or real(out_, *a, **k)
    out = {}
    for fused in (True, False):
        calls.clear()
        lps = compute_logprobs(model, batches, temperature=0.8, with_entropy=True, fused_logprobs=fused)
        for prm in model.parameters():
            prm.grad = None
        metrics = run_schedule(
            model,
            batches,
            lambda b: make_megatron_loss_func(
                b,
                lcfg,
                tp_group=tp_group,
                cp_group=None,
                num_microbatches=len(batches),
                data_parallel_size=1,
                temperature=0.8,
                compute_entropy=True,
            ),
            forward_only=False,
            fused_logprobs=fused,
        )
        grads = {n: prm.grad.clone() for n, prm in model.named_parameters() if prm.grad is not None}
        out[fused] = {
            "logprobs": lps,
            "metrics": metrics,
            "grads": grads,
            "calls": list(calls),
            "last": ps.is_pipeline_last_stage(),
            "hidden": int(hf["hidden_size"]),
            "vocab_local": vocab // p.tp,
            "forms": sorted(forms),
        }
    destroy_distributed()
    return out
