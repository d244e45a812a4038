"""DSA indexer replay (rollout.routing_replay=r3 on deepseek_v32 / glm_moe_dsa): the engine (the CPU
server's transformers forward with a KV cache over a left-padded batch) breaks the indexer's exact-zero
ties by the length of its own rows, the trainer by the whole sequence, so their log-probs differ; with
the engine's routes and indexer selection replayed the trainer's old log-probs equal the engine's to
fp32 rounding, padded and packed; a selection shifted by one token does not."""

from __future__ import annotations

import pytest

from distributed_harness import run_ranks
from indexer_replay_workers import dsa_gaps, make_dsa_records

FP32 = 1e-5
CLEAR = 1e-3
# one indexer head: about half of the scores are exact zeros after the ReLU (ties at the k-th place)
TIES = dict(index_n_heads=1, index_topk=4)


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa"])
def case(request, tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model

    out = str(tmp_path_factory.mktemp(request.param) / "hf")
    save_tiny_hf_model(request.param, out, seed=7, **TIES)
    return request.param, out, make_dsa_records(out)


def test_engine_selection_shape_and_values(case):
    _, _, records = case
    for r in records:
        sel = r.indexer_topk
        assert sel.shape[0] == r.length - 1 and sel.shape[2] == TIES["index_topk"], sel.shape
        for t in range(sel.shape[0]):
            keys = [k for k in sel[t, 0].tolist() if k >= 0]
            assert len(keys) == min(t + 1, TIES["index_topk"]) and max(keys) <= t, (t, sel[t, 0])


def test_r3_replays_the_indexer_one_rank(case):
    name, hf_dir, records = case
    (res,) = run_ranks(dsa_gaps, 1, [dict()], hf_dir, records)
    e = res[0]
    for layout in ("padded", "packed"):
        gaps = {m: e[(layout, m)]["gap"] for m in ("off", "r3", "r3_shifted")}
        assert e[(layout, "r3")]["tokens"] > 0
        assert gaps["r3"] <= FP32, (name, layout, gaps)
        assert gaps["off"] > CLEAR, (name, layout, gaps)  # ties broken differently by the engine
        assert gaps["r3_shifted"] > CLEAR, (name, layout, gaps)  # a one-token shift is caught
