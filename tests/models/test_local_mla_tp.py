"""The local spec's MLA under TP2 (``models/deepseek_v3/local_attention.py``: ``linear_kv_down_proj``'s
output gathered by a hook of ``LocalMLASelfAttention``), with and without sequence parallelism: the
gradients of ``linear_kv_down_proj`` (its RoPE key rows), ``linear_q_down_proj`` and the embedding equal
one rank's (rel 1e-5; without the RoPE key's gradient summed over TP they are 0.2-1% off). A dense tiny
DeepSeek-V3 (every layer dense), since an MoE model with TP > 1 needs sequence parallelism; the MoE
layout with sequence parallelism is tests/models/test_family_training_parity.py's."""

from __future__ import annotations

import torch

from distributed_harness import run_ranks

NAMES = ("linear_kv_down_proj.weight", "linear_q_down_proj.weight", "word_embeddings.weight")


def _grads(rank, world, hf_dir, sequence_parallel):
    """{parameter name: its gradient at full size} of sum(logits * r) for one fixed row of 16 tokens
    (r [1, 16, V] random, each rank its vocab shard); the parameters of ``NAMES`` are split along
    dim 0 (column / vocab parallel) and complete per shard, so the shards are concatenated."""
    import torch.distributed as dist

    from gspo_megatron.models.build import build_model
    from gspo_megatron.models.hf_config import load_hf_config
    from gspo_megatron.models.weights import load_hf_weights
    from gspo_megatron.runtime.distributed import ParallelLayout, init_distributed

    init_distributed(ParallelLayout(tp=world, sequence_parallel=sequence_parallel))
    hf = load_hf_config(hf_dir)
    model = build_model(hf, world)
    load_hf_weights(model, hf_dir)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, int(hf["vocab_size"]), (1, 16), generator=g)
    logits = model(ids, torch.arange(16).unsqueeze(0), attention_mask=None)  # [1, 16, V / tp]
    shard = logits.shape[-1]
    r = torch.randn(1, 16, shard * world, generator=g)[..., rank * shard : (rank + 1) * shard]
    (logits.float() * r).sum().backward()
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(NAMES):
            grad = (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad).detach().double()
            if world > 1:
                parts = [torch.empty_like(grad) for _ in range(world)]
                dist.all_gather(parts, grad.contiguous())
                grad = torch.cat(parts)
            out[name] = grad
    return out


def test_rope_key_gradient_under_tp2_with_and_without_sequence_parallel(tmp_path):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    hf_dir = str(tmp_path / "hf")
    save_tiny_hf_model("deepseek_v3", hf_dir, seed=11, first_k_dense_replace=4)  # 4 layers, all dense
    ref = run_ranks(_grads, 1, hf_dir, False)[0]
    assert len(ref) == 9  # the embedding, and both down projections of 4 layers
    for sequence_parallel in (False, True):
        got = run_ranks(_grads, 2, hf_dir, sequence_parallel)[0]
        assert got.keys() == ref.keys()
        for name, g in ref.items():
            err = float((got[name] - g).norm() / g.norm())
            assert err < 1e-5, f"sequence_parallel={sequence_parallel} {name}: rel err {err:.3g}"
