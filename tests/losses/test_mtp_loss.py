"""The MTP draft's loss and acceptance (gspo_megatron/losses/mtp_loss.py) against closed forms: explicit
per-position loops over padded and packed rows, full-vocabulary log_softmax / argmax, and the
vocab-parallel argmax on two gloo ranks equal to the one-rank one (ties and Megatron's padded
vocabulary columns included)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from distributed_harness import run_ranks
from gspo_megatron.losses.mtp_loss import (
    DraftStates,
    draft_acceptance,
    draft_targets,
    mtp_loss_sum,
    vocab_parallel_argmax,
)


def _packed(cu: list[int]) -> PackedSeqParams:
    t = torch.tensor(cu, dtype=torch.int32)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=t,
        cu_seqlens_kv=t,
        max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
        max_seqlen_kv=max(b - a for a, b in zip(cu, cu[1:])),
    )


def _rows(labels: torch.Tensor, mask: torch.Tensor, k: int, segments: list[tuple[int, int]]):
    """The reference targets / mask of MTP layer k: per segment [a, b) of a row, position i reads
    labels[i + k] when i + k < b (else 0) and counts when mask[i] and mask[i + k]."""
    tgt = torch.zeros_like(labels)
    m = torch.zeros_like(mask, dtype=torch.float32)
    for row in range(labels.shape[0]):
        for a, b in segments:
            for i in range(a, b):
                if i + k < b:
                    tgt[row, i] = labels[row, i + k]
                    m[row, i] = float(mask[row, i] and mask[row, i + k])
    return tgt, m


def test_draft_targets_padded_and_packed():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(1, 50, (2, 12), generator=g)
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 3:10] = 1
    mask[1, 5:12] = 1
    for k in (1, 2, 3):
        tgt, m = draft_targets(labels, mask, k)
        ref_t, ref_m = _rows(labels, mask, k, [(0, 12)])
        assert torch.equal(tgt, ref_t) and torch.equal(m, ref_m)
    # packed: one row of three sequences; nothing crosses a sequence's end
    cu = [0, 5, 9, 14]
    labels = torch.randint(1, 50, (1, 14), generator=g)
    mask = torch.tensor([[0, 1, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1]])
    for k in (1, 2):
        tgt, m = draft_targets(labels, mask, k, _packed(cu))
        ref_t, ref_m = _rows(labels, mask, k, list(zip(cu, cu[1:])))
        assert torch.equal(tgt, ref_t) and torch.equal(m, ref_m)


def test_mtp_loss_sum_is_the_cross_entropy_of_each_layer():
    g = torch.Generator().manual_seed(1)
    b, s, h, v = 2, 9, 6, 17
    drafts = [torch.randn(b, s, h, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.long)
    mask[0, 2:8] = 1
    mask[1, 4:9] = 1
    total, count = mtp_loss_sum(DraftStates(drafts, weight), labels, mask, chunk_size=4)
    ref, n = torch.zeros((), dtype=torch.float64), 0.0
    for k, d in enumerate(drafts, start=1):
        tgt, m = _rows(labels, mask, k, [(0, s)])
        logp = torch.log_softmax(d @ weight.t(), dim=-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        ref = ref - (logp * m).sum()
        n += float(m.sum())
    torch.testing.assert_close(total.double(), ref, rtol=1e-6, atol=1e-6)
    assert float(count) == n
    # the gradient reaches the draft's states; the (detached) weight has none
    total.backward()
    assert all(d.grad is not None and d.grad.abs().sum() > 0 for d in drafts)


def test_draft_acceptance_counts_top1_equal_to_the_emitted_token():
    g = torch.Generator().manual_seed(2)
    b, s, h, v = 3, 10, 5, 13
    first = torch.randn(b, s, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    proposal = (first @ weight.t()).argmax(-1)
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[:, 1:] = torch.where(torch.rand(b, s - 1, generator=g) < 0.5, proposal[:, :-1], labels[:, 1:])
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, :3] = 0
    acc, pos = draft_acceptance(DraftStates([first], weight), labels, mask)
    tgt, m = _rows(labels, mask, 1, [(0, s)])
    assert float(pos) == float(m.sum())
    assert float(acc) == float(((proposal == tgt).float() * m).sum())
    assert 0 < float(acc) < float(pos)


def _argmax_worker(rank: int, world: int, hidden, weight, vocab_size):
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shard = weight.chunk(world, dim=0)[rank]
    return vocab_parallel_argmax(hidden, shard, dist.group.WORLD, vocab_size)


def test_vocab_parallel_argmax_equals_the_full_argmax_on_two_ranks():
    g = torch.Generator().manual_seed(3)
    n, h, v = 11, 4, 16
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g)
    weight[9] = weight[2]  # a tie across the two shards: the lower index wins, as torch.argmax
    hidden[0] = weight[2] * 10
    real = 14  # Megatron padded the vocabulary to 16: columns 14, 15 never win
    weight[15] = hidden[1] * 10
    full = (hidden @ weight.t())[:, :real].argmax(-1)
    one = vocab_parallel_argmax(hidden, weight, None, real)
    assert torch.equal(one, full) and int(full[0]) == 2
    two = run_ranks(_argmax_worker, 2, hidden, weight, real)
    assert torch.equal(two[0], full) and torch.equal(two[1], full)
