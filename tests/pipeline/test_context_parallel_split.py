"""Context-parallel batch slicing: every CP rank's share of a padded micro-batch is Megatron's
load-balanced 2*cp-chunk layout, and gathering the shares gives the rows back exactly."""

import torch

from distributed_harness import run_ranks


def _worker(rank, world):
    import torch.distributed as dist

    from gspo_megatron.pipeline import collate, gather_context_parallel, sequence_multiple, split_for_context_parallel

    dist.init_process_group("gloo")
    seqs = [{"tokens": list(range(3 + i, 12 + 2 * i)), "prompt_len": 2, "old_logprobs": [-0.5] * (7 + i)}
            for i in range(3)]
    batch = collate(seqs, multiple=sequence_multiple(tp=1, cp=world))
    local = split_for_context_parallel(batch, dist.group.WORLD)
    back = {k: gather_context_parallel(local[k], dist.group.WORLD) for k in ("tokens", "labels", "loss_mask")}
    return batch, local, back


def test_split_and_gather_round_trip():
    results = run_ranks(_worker, 2)
    batch = results[0][0]
    s = batch["tokens"].shape[1]
    assert s % 4 == 0  # 2 * cp chunks
    c = s // 4
    for rank, (_, local, back) in enumerate(results):
        # rank r holds chunks r and 2*cp-1-r
        want = torch.cat([batch["tokens"][:, rank * c:(rank + 1) * c],
                          batch["tokens"][:, (3 - rank) * c:(4 - rank) * c]], dim=1)
        assert torch.equal(local["tokens"], want)
        assert torch.equal(local["advantages"] if "advantages" in local else torch.zeros(0),
                           batch.get("advantages", torch.zeros(0)))
        for k, v in back.items():
            assert torch.equal(v, batch[k]), k
    # the two shares cover every response token exactly once
    total = sum(r[1]["loss_mask"].sum() for r in results)
    assert total == batch["loss_mask"].sum()
