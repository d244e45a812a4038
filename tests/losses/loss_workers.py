"""Rank functions for the multi-rank loss tests (run by distributed_harness.run_ranks on gloo)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_megatron.losses import PolicyLossConfig, policy_loss_flat, vocab_parallel_logprobs

# (mode, options) exercised by the TP and CP invariance tests.
CASES = [
    ("gspo", dict(kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)),
    ("gspo", dict(tis_cap=1.01)),
    ("gspo_token", dict(kl_coef=0.05, kl_estimator="k2", entropy_coef=0.01, tis_cap=1.01)),
    ("grpo", dict(kl_coef=0.05, kl_estimator="k1", entropy_coef=0.01, tis_cap=1.1)),
    ("grpo", dict(aggregation="token-mean", entropy_coef=0.02)),
    ("gspo", dict(tis_cap=1.02, tis_mode="mask")),  # half the sequences dropped; the weight from the CP-reduced sum
    ("grpo", dict(tis_cap=1.05, tis_level="sequence", tis_mode="mask")),
    # on-policy distillation (losses/distill_loss.py): the sampled-token reverse KL through the
    # policy's ratio, and the top-k divergences over the student's vocab-parallel log-probs of the
    # teacher's top-k ids (K targets per token in one pass, as megatron_loss.student_topk)
    ("grpo", dict(distill_coef=0.5, distill_loss="reverse_kl", kl_coef=0.05, kl_estimator="k3")),
    ("gspo", dict(distill_coef=0.7, distill_loss="reverse_kl", reward_coef=0.0, tis_cap=1.1)),
    ("gspo", dict(distill_coef=0.3, distill_loss="topk_forward_kl", entropy_coef=0.01)),
    ("gspo_token", dict(distill_coef=0.4, distill_loss="topk_reverse_kl", reward_coef=0.5)),
]


def loss_from_logits(logits, data, mode, options, *, tp_group=None, cp_group=None, normalizer=None):
    """Vocab-parallel log-probs -> policy_loss_flat; ``data`` holds flat per-token tensors of this rank."""
    lp, ent = vocab_parallel_logprobs(logits, data["targets"], tp_group=tp_group, temperature=0.8, chunk_size=5)
    clip = (8e-3, 1e-2) if mode == "grpo" else (3e-3, 4e-3)
    cfg = PolicyLossConfig(mode=mode, clip_low=clip[0], clip_high=clip[1], **options)
    topk = None
    if cfg.distill_loss.startswith("topk"):
        ids = data["topk_ids"]  # [N, K]: all K scored in one vocab-parallel pass
        student = vocab_parallel_logprobs(logits, ids, tp_group=tp_group, temperature=0.8, chunk_size=5)[0]
        topk = (student, data["topk_teacher"])
    return policy_loss_flat(
        lp,
        data["old"],
        data["adv"],
        data["mask"],
        data["seq"],
        data["num_seqs"],
        cfg,
        ref_logprobs=data["ref"],
        entropy=ent,
        engine_logprobs=data["engine"],
        cp_group=cp_group,
        normalizer=normalizer,
        teacher_logprobs=data["teacher"] if cfg.distill_coef else None,
        topk_logprobs=topk,
    )


def _init(rank: int, world: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)


def tp_worker(rank: int, world: int, logits: torch.Tensor, data: dict) -> list:
    """Each rank holds a vocab shard of the logits; returns (loss, metrics, logits grad shard) per case."""
    _init(rank, world)
    v_local = logits.shape[-1] // world
    out = []
    for mode, options in CASES:
        shard = logits[:, rank * v_local : (rank + 1) * v_local].clone().requires_grad_(True)
        loss, metrics = loss_from_logits(shard, data, mode, options, tp_group=dist.group.WORLD)
        loss.backward()
        out.append((loss.detach(), metrics, shard.grad))
    return out


def tp_padded_vocab_worker(rank: int, world: int, logits: torch.Tensor, cases: list, weights: torch.Tensor) -> list:
    """Vocab shards of a padded output layer: for each (vocab_size, targets) in ``cases`` only the first
    ``vocab_size`` columns are real tokens. Returns (logprobs, entropy, logits grad shard) per case."""
    _init(rank, world)
    v_local = logits.shape[-1] // world
    out = []
    for vocab_size, targets in cases:
        shard = logits[:, rank * v_local : (rank + 1) * v_local].clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(
            shard, targets, tp_group=dist.group.WORLD, vocab_size=vocab_size, chunk_size=3
        )
        ((lp * weights).sum() + (ent * weights.flip(0)).sum()).backward()
        out.append((lp.detach(), ent.detach(), shard.grad))
    return out


def cp_worker(rank: int, world: int, logits: torch.Tensor, data: dict, owner: torch.Tensor) -> list:
    """Each rank holds the tokens ``owner == rank`` (per-token values split across CP ranks)."""
    _init(rank, world)
    idx = (owner == rank).nonzero().squeeze(1)
    local = {
        k: (v[idx] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == owner.numel() else v)
        for k, v in data.items()
    }
    out = []
    for mode, options in CASES:
        x = logits[idx].clone().requires_grad_(True)
        loss, metrics = loss_from_logits(x, local, mode, options, cp_group=dist.group.WORLD)
        loss.backward()
        out.append((loss.detach(), metrics, x.grad, idx))
    return out
