"""bench/inflight.py's GPU-scale time model (no training): its shares are shares, and the schemes order
as the model says they must. No timing is measured here."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_inflight", os.path.join(REPO, "bench", "inflight.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


BENCH = _bench()
SCALES = {
    "default": BENCH.Scale(),
    "trainer_bound": BENCH.Scale(train_tok_s=2000.0),  # T far above the generation time
    "short_tail": BENCH.Scale(p99=6000.0, max_tokens=8192),
    "more_samples_than_slots": BENCH.Scale(batch=2048, sim_steps=8),
}


@pytest.mark.parametrize("name", sorted(SCALES))
def test_time_model_invariants(name):
    s = SCALES[name]
    m = BENCH.time_model(s)
    sync = m["sync"]
    for scheme in BENCH.SCHEMES:
        r = m[scheme]
        for key in ("engine_idle", "trainer_idle", "reprefill"):
            assert 0.0 <= r[key] <= 1.0, (scheme, key, r)
        assert r["step_s"] > 0, (scheme, r)
        # no scheme is slower than the synchronous loop, none faster than its slowest side allows
        assert r["step_s"] <= sync["step_s"] + 1e-9, (scheme, r, sync)
        assert r["step_s"] >= m["_"]["T"] + s.sync_s - 1e-9, (scheme, r)
        assert r["engine_idle"] <= sync["engine_idle"] + 1e-9, (scheme, r, sync)
        assert r["trainer_idle"] <= sync["trainer_idle"] + 1e-9, (scheme, r, sync)
    # in-flight keeps the engines at least as busy as whole-batch overlap and as the partial rollout's loop
    for scheme in ("in-flight in_place", "in-flight retract/abort"):
        assert m[scheme]["engine_idle"] <= m["overlap N=1"]["engine_idle"] + 1e-9
        assert m[scheme]["engine_idle"] <= m["partial rollout"]["engine_idle"] + 1e-9
    # re-prefill only costs: in place is never slower than retract / abort
    assert m["in-flight in_place"]["step_s"] <= m["in-flight retract/abort"]["step_s"] + 1e-9
    # a batch's makespan is at least its decoding spread over every slot
    assert m["_"]["G"] >= m["_"]["W_per_slot"] - 1e-9
    # the synchronous and overlapped loops have no sample living through a sync
    assert sync["span_max"] == 0 and m["overlap N=1"]["span_max"] == 0


def test_time_model_is_deterministic_and_tail_sensitive():
    s = BENCH.Scale()
    assert BENCH.time_model(s) == BENCH.time_model(s)
    # a longer tail (same median) widens the synchronous loop's idle share and in-flight's advantage
    long = BENCH.time_model(dataclasses.replace(s, p99=65536.0, max_tokens=65536))
    short = BENCH.time_model(dataclasses.replace(s, p99=8192.0, max_tokens=65536))
    assert long["sync"]["engine_idle"] > short["sync"]["engine_idle"]
    gain = {k: m["sync"]["step_s"] / m["in-flight in_place"]["step_s"] for k, m in (("long", long), ("short", short))}
    assert gain["long"] > gain["short"] >= 1.0


def test_model_only_cli_prints_the_table(capsys):
    assert BENCH.main(["--model-only", "--m-sim-steps", "4"]) == 0
    out = capsys.readouterr().out
    for scheme in BENCH.SCHEMES:
        assert f"| {scheme} |" in out
    assert BENCH.first_char("", "7", 7) == 1.0 and BENCH.first_char("", "", 7) == 0.0
