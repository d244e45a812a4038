"""Routing replay under activation recomputation (issue 32): with ``model.recompute=true`` Megatron
re-runs every layer's forward in backward, after the micro-batch's forward has cleared its replay
targets (with PP 1F1B, after later micro-batches' forwards set theirs). The trainer must route the
recomputed forward exactly as the forward did, so ``train_on_batch`` with recompute leaves the same
gradients and loss as without:

- r3 on routes no router would pick (every token on expert 0 plus random ones: uneven loads), 1 rank
  and pp2 (3 micro-batches: stage 0 runs the second forward before the first backward);
- r2 with two mini-batches and a large learning rate (lr 0.5: the second mini-batch's routers have
  moved away from the record, so the replay matters there);
- DeepSeek-V3.2 (DSA): r3 replays the indexer's selection too (shifted one query: not the
  indexer's own), also in the recomputed forward.

Controls: recompute without replay is exact too, and the replay really changes the gradients."""

from __future__ import annotations

import pytest

from distributed_harness import run_ranks
from route_replay_recompute_workers import grads, skewed
from route_replay_workers import make_engine_records


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_moe", seed=5)[0]


@pytest.fixture(scope="module")
def records(hf_dir):
    return skewed(make_engine_records(hf_dir, 0.0, max_new_tokens=8), num_experts=4)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _same_run(plain: dict, recomputed: dict, what) -> None:
    assert _max_diff(plain["grads"], recomputed["grads"]) <= 1e-6, what
    if plain["last_stage"]:
        for k, v in plain["metrics"].items():
            if k.startswith(("loss/", "train/grad_norm")):
                assert recomputed["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (what, k)


def test_r3_and_r2_gradients_equal_without_recompute_one_rank(hf_dir, records):
    runs = [("off", False, 1), ("off", True, 1), ("r3", False, 1), ("r3", True, 1)]
    runs += [("off", False, 2), ("r2", False, 2), ("r2", True, 2)]
    (out,) = run_ranks(grads, 1, dict(), hf_dir, records, runs)
    _same_run(out[("off", False, 1)], out[("off", True, 1)], "no replay")
    for mode, minis in (("r3", 1), ("r2", 2)):
        plain, recomputed = out[(mode, False, minis)], out[(mode, True, minis)]
        _same_run(plain, recomputed, mode)
        assert plain["backward_replays"] == 0, mode  # nothing runs a forward in backward
        assert recomputed["backward_replays"] > 0, mode  # the recomputed forwards replayed
    assert _max_diff(out[("r3", False, 1)]["grads"], out[("off", False, 1)]["grads"]) > 1e-4  # replay matters
    assert out[("r3", False, 1)]["metrics"]["rollout/route_agreement"] < 0.5  # far from the routers' own
    # r2: after the first update the second mini-batch's routers choose otherwise than the record
    assert _max_diff(out[("r2", False, 2)]["grads"], out[("off", False, 2)]["grads"]) > 1e-4


def test_r3_gradients_equal_without_recompute_pp2(hf_dir, records):
    ranks = run_ranks(grads, 2, dict(pp=2), hf_dir, records, [("r3", False, 1), ("r3", True, 1)])
    for out in ranks:
        plain, recomputed = out[("r3", False, 1)], out[("r3", True, 1)]
        _same_run(plain, recomputed, "pp2")
        assert recomputed["backward_replays"] > 0


def test_dsa_indexer_replay_under_recompute(tmp_path_factory):
    from gspo_megatron.models.tiny import save_tiny_hf_model
    from indexer_replay_workers import make_dsa_records, shifted_selection

    d = str(tmp_path_factory.mktemp("dsa_recompute") / "hf")
    save_tiny_hf_model("deepseek_v32", d, seed=7, index_n_heads=1, index_topk=4)
    # the engine's own routes (unperturbed: the trainer's routers mostly agree), a selection that is
    # not the indexer's: what the recompute must replay here is mostly the indexer's
    recs = shifted_selection(make_dsa_records(d, max_new_tokens=8))
    (out,) = run_ranks(grads, 1, dict(), d, recs, [("off", False, 1), ("r3", False, 1), ("r3", True, 1)])
    plain, recomputed = out[("r3", False, 1)], out[("r3", True, 1)]
    _same_run(plain, recomputed, "dsa")
    assert recomputed["backward_replays"] > 0 and recomputed["backward_selections"] > 0
    assert plain["backward_selections"] == 0
    assert plain["metrics"]["rollout/indexer_agreement"] < 0.9  # the shifted selection is not the indexer's
    assert _max_diff(plain["grads"], out[("off", False, 1)]["grads"]) > 1e-4
