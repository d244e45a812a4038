"""R2 and the KL reference model under routing replay (issue 24), through ``train_on_batch``:

- r3 with ``gspo.kl_coef`` > 0: the reference model replays the engine's routes as the policy does,
  so on the first update (same weights) its KL term is zero to fp32 rounding, while the reference's own
  routing is far from the (perturbed) engine's;
- r2: the old-policy forward routes by itself; the reference model and every policy forward (the
  second mini-batch after an update with a large learning rate) replay exactly those ids on every
  labelled token; the updated policy routing by itself (no replay) picks other experts.
1 rank, tp2 (sequence parallel: each rank's router chunk) and pp2 (each stage's own layers)."""

from __future__ import annotations

import pytest
import torch

from distributed_harness import run_ranks
from gspo_megatron.engines.routing import NO_ROUTE
from route_replay_workers import make_engine_records, r2_and_reference


@pytest.fixture(scope="module")
def hf_dir(tiny_hf_checkpoint):
    return tiny_hf_checkpoint("qwen3_moe", seed=5)[0]


@pytest.fixture(scope="module")
def records(hf_dir):
    return make_engine_records(hf_dir, 3.0)


def _check(entries: list[dict], name: str) -> None:
    rep = [e for e in entries if e["reporter"]]
    assert rep, name
    for e in rep:
        assert e["r3"]["loss/kl_ref"] <= 1e-6, (name, e["r3"])
        assert e["ref_own_gap"] > 1e-3, (name, e["ref_own_gap"])  # without replay the reference is off
    replayed = changed = 0
    for e in entries:
        calls = e["calls"]
        assert len(calls["old"]) == len(calls["ref"]) == len(calls["policy"]) == len(e["after"]) > 0, name
        for (lo, t_old, own), (lr_, t_ref, ref_ids), (lp, t_pol, pol_ids), (la, _, after) in zip(
            calls["old"], calls["ref"], calls["policy"], e["after"]
        ):
            assert lo == lr_ == lp == la, name
            assert t_old is None, name  # the old forward routes by itself
            assert t_pol is not None and t_ref is not None, name  # the record reached both
            assert torch.equal(t_pol, t_ref), name
            valid = (t_pol != NO_ROUTE).all(-1)
            assert valid.any(), name
            assert torch.equal(t_pol[valid], own[valid]), name  # the record is the old forward's choice
            assert torch.equal(pol_ids[valid], own[valid]) and torch.equal(ref_ids[valid], own[valid]), name
            replayed += int(valid.sum())
            changed += int((after.sort(-1).values != own.sort(-1).values).any(-1)[valid].sum())
    assert 0 < changed < replayed, (name, changed, replayed)  # without R2 the update moves routes


def test_r2_and_reference_one_rank(hf_dir, records):
    (res,) = run_ranks(r2_and_reference, 1, [dict()], hf_dir, records)
    _check([res[0]], "1 rank")


def test_r2_and_reference_tp2_pp2(hf_dir, records):
    ranks = run_ranks(r2_and_reference, 2, [dict(tp=2), dict(pp=2)], hf_dir, records)
    for i, name in enumerate(("tp2", "pp2")):
        _check([r[i] for r in ranks], name)
