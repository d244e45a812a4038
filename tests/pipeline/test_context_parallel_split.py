"""Context-parallel batch slicing: every CP rank's share of a padded micro-batch is Megatron's
load-balanced 2*cp-chunk layout for EVERY per-token tensor (tokens, positions, labels, loss mask,
sequence index, old / engine / reference log-probs), per-sequence values (advantages) stay whole, and
gathering the shares gives the rows back exactly."""

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.sample import Sample

PER_TOKEN = (
    "tokens",
    "position_ids",
    "labels",
    "loss_mask",
    "seq_index",
    "old_logprobs",
    "engine_logprobs",
    "ref_logprobs",
)


def _records():
    out = []
    for i in range(3):
        n_prompt, n_resp = 2 + i, 7 + i
        out.append(
            Sample.from_tokens(
                list(range(3 + i, 3 + i + n_prompt + n_resp)),
                n_prompt,
                # distinct values per sequence and position: a chunk taken from the wrong place shows
                old_logprobs=[-(i + 1) - 0.01 * j for j in range(n_resp)],
                engine_logprobs=[-(i + 1) - 0.02 * j for j in range(n_resp)],
                ref_logprobs=[-(i + 1) - 0.03 * j for j in range(n_resp)],
                advantage=0.5 * i - 0.7,
            )
        )
    return out


def _worker(rank, world):
    import torch.distributed as dist

    from gspo_megatron.trainer.micro_batches import (
        collate,
        gather_context_parallel,
        sequence_multiple,
        split_for_context_parallel,
    )

    dist.init_process_group("gloo")
    batch = collate(_records(), multiple=sequence_multiple(tp=1, cp=world))
    local = split_for_context_parallel(batch, dist.group.WORLD)
    back = {k: gather_context_parallel(local[k], dist.group.WORLD) for k in PER_TOKEN}
    return batch, local, back


def test_split_and_gather_round_trip():
    results = run_ranks(_worker, 2)
    batch = results[0][0]
    assert set(PER_TOKEN) | {"advantages"} <= set(batch)
    b, s = batch["tokens"].shape
    assert s % 4 == 0  # 2 * cp chunks
    c = s // 4
    # the records' values landed in the batch (so the comparisons below compare real data)
    assert torch.equal(batch["advantages"], torch.tensor([r.advantage for r in _records()]))
    assert batch["old_logprobs"][2, 3] == -3.0 and batch["old_logprobs"][0, 1 + 6].item() == pytest.approx(-1.06)
    for rank, (_, local, back) in enumerate(results):
        for k in PER_TOKEN:
            # rank r holds chunks r and 2*cp-1-r of every per-token tensor
            want = torch.cat(
                [batch[k][:, rank * c : (rank + 1) * c], batch[k][:, (3 - rank) * c : (4 - rank) * c]], dim=1
            )
            assert local[k].shape == (b, 2 * c), k
            assert torch.equal(local[k], want), (rank, k)
            assert torch.equal(back[k], batch[k]), (rank, k)
        # positions are the global ones (rotary embeddings need them), not 0..s/cp-1
        assert local["position_ids"][0].tolist() == list(range(rank * c, (rank + 1) * c)) + list(
            range((3 - rank) * c, (4 - rank) * c)
        )
        assert torch.equal(local["advantages"], batch["advantages"])  # per sequence: kept whole
    # the two shares cover every response token exactly once, with its old log-prob
    assert sum(r[1]["loss_mask"].sum() for r in results) == batch["loss_mask"].sum()
    assert torch.isclose(
        sum((r[1]["old_logprobs"] * r[1]["loss_mask"]).sum() for r in results),
        (batch["old_logprobs"] * batch["loss_mask"]).sum(),
    )
