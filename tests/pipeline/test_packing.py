"""Sequence packing (gspo_megatron/trainer/packing.py): the plan's balance and budget, the packed layout, and
packed == padded through the real model and trainer code (per-token log-probs, loss, gradients
within 1e-5 in fp32; the scorer's log-probs too) on one rank and in tp2, pp2, ep2, dp2, on sequences whose lengths differ 15x."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.trainer.micro_batches import collate
from gspo_megatron.trainer.packing import (
    balance_over_ranks,
    collate_packed,
    context_parallel_index,
    pack_first_fit,
    plan_micro_batches,
)
from packing_workers import make_records, packed_vs_padded


def test_dp_balance_on_a_skewed_batch():
    # one very long sequence among many short ones, and a few medium ones
    lengths = [2000] + [12] * 40 + [300, 280, 700, 64, 5, 5, 900]
    for ranks in (2, 3, 4):
        parts = balance_over_ranks(lengths, ranks)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))  # each sequence once
        loads = [sum(lengths[i] for i in p) for p in parts]
        assert max(loads) - min(loads) <= max(lengths)
    # a batch where balancing is possible exactly: the spread is at most one (the last placed) sequence
    lengths = [100, 90, 60, 50, 40, 30, 20, 10, 5, 5]
    loads = [sum(lengths[i] for i in p) for p in balance_over_ranks(lengths, 2)]
    assert max(loads) - min(loads) <= min(lengths) * 2
    # by sequence count, round-robin would put 100, 60, 40, 20, 5 = 225 vs 185 on the two ranks
    rr = [sum(lengths[r::2]) for r in range(2)]
    assert max(loads) - min(loads) < max(rr) - min(rr)


def test_plan_respects_budget_and_equalizes_micro_batch_counts():
    lengths = [61, 4, 5, 33, 6, 47, 4, 12, 58, 7, 5, 21, 64, 64, 3]
    for ranks, budget in ((1, 64), (2, 64), (3, 100), (2, 1000)):
        plan = plan_micro_batches(lengths, ranks, budget)
        assert len({len(p) for p in plan}) == 1  # the same number of micro-batches on every rank
        seen = sorted(i for p in plan for mb in p for i in mb)
        assert seen == list(range(len(lengths)))
        for p in plan:
            for mb in p:
                assert sum(lengths[i] for i in mb) <= budget
    # first-fit decreasing needs no more bins than 11/9 OPT + 1; here the optimum is obvious
    assert len(pack_first_fit(range(4), [50, 50, 50, 50], 100)) == 2
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=10"):
        pack_first_fit([0], [11], 10)
    # context parallel: segments cost their length rounded up to 2*cp
    plan = plan_micro_batches([3, 3, 3], 1, 8, seg_multiple=4)
    assert [len(mb) for mb in plan[0]] == [2, 1]


def test_packed_layout():
    recs = make_records()[:4]  # lengths 61, 4, 5, 33
    b = collate_packed(recs, pad_id=7, row_multiple=4, seq_ids=[10, 11, 12, 13])
    assert b["tokens"].shape == (1, 104)  # 103 tokens + one padding token
    assert b["cu_seqlens"].tolist() == [0, 61, 65, 70, 103, 104] and b["cu_seqlens"].dtype == torch.int32
    assert b["max_seqlen"] == 61 and b["num_seqs"] == 4 and b["num_real_tokens"] == 103
    assert b["position_ids"][0, 61:65].tolist() == [0, 1, 2, 3]  # positions restart per sequence
    padded = collate(recs, pad_id=7)
    for i, (a, e) in enumerate(zip(b["cu_seqlens"][:-2].tolist(), b["cu_seqlens"][1:-1].tolist())):
        n = e - a
        for k in ("tokens", "labels", "loss_mask", "engine_logprobs"):
            assert torch.equal(b[k][0, a:e], padded[k][i, :n]), k
        assert (b["seq_index"][0, a:e] == i).all()
    assert b["loss_mask"][0, 103:].sum() == 0 and b["tokens"][0, 103] == 7
    assert torch.equal(b["advantages"], padded["advantages"])
    empty = collate_packed([], row_multiple=4)
    assert empty["tokens"].shape == (1, 4) and empty["loss_mask"].sum() == 0 and empty["num_real_tokens"] == 0
    # CP: each segment's chunks r and 2cp-1-r
    idx = context_parallel_index(torch.tensor([0, 8, 12]), 2, 1)
    assert idx.tolist() == [2, 3, 4, 5, 9, 10]


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_moe", seed=5)[0]


def _check(results, layout_name):
    merged = {}
    for rank_results in results:
        e = rank_results
        assert e["finite"]
        assert e["grad_max"] > 1e-4, layout_name  # the gradients are not trivially zero
        assert e["grad_diff"] <= 1e-5, (layout_name, e["grad_diff"])
        assert e["packed"]["loss"] == pytest.approx(e["padded"]["loss"], abs=1e-5, rel=1e-5), layout_name
        assert e["padded"]["loss"] != 0.0
        for mode in ("padded", "packed"):
            for sid, lp in e[mode]["logprobs"].items():
                merged.setdefault(mode, {})[sid] = lp
    # packing computes fewer tokens than padding on this long-tailed batch (summed over the ranks:
    # with dp2 the two modes split the sequences differently)
    (c_pad, r_pad), (c_pack, r_pack) = (
        [sum(x) for x in zip(*(e[m]["pad"] for e in results))] for m in ("padded", "packed")
    )
    assert r_pad == r_pack and c_pack < c_pad
    scored = [e["score"] for e in results if "score" in e]
    assert len(scored) == 1  # global rank 0
    for a, b in zip(*scored[0]):
        assert len(a) == len(b) > 0
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-5, rtol=0, msg=layout_name)
    n = len(make_records())
    assert sorted(merged["padded"]) == sorted(merged["packed"]) == list(range(n)), layout_name
    for sid in range(n):
        a, b = torch.tensor(merged["padded"][sid]), torch.tensor(merged["packed"][sid])
        assert a.shape == b.shape and a.numel() > 0
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0, msg=f"{layout_name} sequence {sid}")


def test_packed_equals_padded_one_rank(hf_dir):
    (res,) = run_ranks(packed_vs_padded, 1, [dict()], hf_dir, 64)
    _check([res[0]], "single rank")


def test_packed_equals_padded_mla(tmp_path):
    """DeepSeek-V3's multi-latent attention (its own local core attention and rotary path)."""
    from gspo_megatron.models.tiny import save_tiny_hf_model

    save_tiny_hf_model("deepseek_v3", str(tmp_path / "hf"), seed=5)
    (res,) = run_ranks(packed_vs_padded, 1, [dict()], str(tmp_path / "hf"), 64)
    _check([res[0]], "deepseek_v3")


def test_packed_equals_padded_tp2_pp2_ep2_dp2(hf_dir):
    layouts = [dict(tp=2), dict(pp=2), dict(ep=2), dict()]  # the last: dp2
    ranks = run_ranks(packed_vs_padded, 2, layouts, hf_dir, 64)
    for i, name in enumerate(("tp2", "pp2", "ep2", "dp2")):
        _check([r[i] for r in ranks], name)
    # dp2: the two replicas ran the same number of micro-batches, with balanced token counts
    dp_runs = [r[3]["packed"] for r in ranks]
    assert dp_runs[0]["num_micro"] == dp_runs[1]["num_micro"]
    loads = [sum(d["real_per_micro"]) for d in dp_runs]
    assert abs(loads[0] - loads[1]) <= max(r.length for r in make_records())


def test_context_parallel_split_of_a_packed_row():
    from packing_workers import cp_round_trip

    ranks = run_ranks(cp_round_trip, 2)
    batch = ranks[0][0]
    cu = batch["cu_seqlens"].tolist()
    assert all((b - a) % 4 == 0 for a, b in zip(cu[:-1], cu[1:]))  # every segment: 2*cp chunks
    for rank, (_, local, back) in enumerate(ranks):
        want = context_parallel_index(batch["cu_seqlens"], 2, rank)
        assert local["tokens"].shape[1] == batch["tokens"].shape[1] // 2
        for k, v in back.items():
            assert torch.equal(local[k], batch[k][:, want]), k
            assert torch.equal(v, batch[k]), k  # the gather puts every chunk back
        # positions are per sequence: each local chunk continues its own sequence's positions
        assert local["position_ids"][0, :2].tolist() == [rank * (cu[1] // 4), rank * (cu[1] // 4) + 1]
