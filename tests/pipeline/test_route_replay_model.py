"""Routing replay (R3) end to end through the trainer's code: an engine whose router choices differ
from the trainer's (``--router-logit-perturbation``), then the trainer's old-policy log-probs equal the
engine's to fp32 rounding with the engine's routes replayed, padded and packed, on 1 rank, tp2, ep2
and pp2; without replay, or with the routes shifted by one token, they do not."""

from __future__ import annotations

import pytest

from distributed_harness import run_ranks
from route_replay_workers import make_engine_records, old_logprob_gaps

PERTURB = 3.0
FP32 = 1e-5  # fp32 rounding of a tiny model's log-probs (measured: 4.8e-7 on 1 rank)
CLEAR = 1e-3


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_moe", seed=5)[0]


@pytest.fixture(scope="module")
def records(hf_dir):
    return make_engine_records(hf_dir, PERTURB)


def _check(entries: list[dict], name: str) -> None:
    for layout in ("padded", "packed"):
        gaps = {m: max(e[(layout, m)]["gap"] for e in entries) for m in ("off", "r3", "r3_shifted")}
        assert sum(e[(layout, "r3")]["tokens"] for e in entries) > 0, name
        assert gaps["r3"] <= FP32, (name, layout, gaps)
        assert gaps["off"] > CLEAR, (name, layout, gaps)  # the perturbation really changes routing
        assert gaps["r3_shifted"] > CLEAR, (name, layout, gaps)  # a one-token shift is caught
        agree = [sum(e[(layout, "r3")]["agree"][k] for e in entries) for k in (0, 1)]
        assert 0 < agree[0] < agree[1], (name, layout, agree)  # counted from the router's own choice


def test_r3_one_rank_padded_and_packed(hf_dir, records):
    (res,) = run_ranks(old_logprob_gaps, 1, [dict()], hf_dir, records, True)
    _check([res[0]], "1 rank")
    m = res[0]["metrics"]
    assert m["rollout/logprob_abs_diff"] <= FP32
    assert 0.0 < m["rollout/route_agreement"] < 1.0


def test_r3_tp2_ep2_pp2(hf_dir, records):
    layouts = [dict(tp=2), dict(ep=2), dict(pp=2)]
    ranks = run_ranks(old_logprob_gaps, 2, layouts, hf_dir, records)
    for i, name in enumerate(("tp2", "ep2", "pp2")):
        _check([r[i] for r in ranks], name)
    # pp2: each stage's routers are its own global layers (the replay reads routed_experts[:, :, layer])
    assert [r[2]["layers"] for r in ranks] == [[0, 1], [2, 3]]
