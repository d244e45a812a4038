"""Routing replay in a GSPO run (issue 24): gspo-train with CPU-server engines whose router choices
are perturbed (``GSPO_CPU_SERVER_ROUTER_PERTURBATION``, the server's ``--router-logit-perturbation``).
With ``rollout.routing_replay=r3`` the trainer's old log-probs equal the engine's (fp32 on both sides)
every step and ``rollout/route_agreement`` shows how often the routers disagreed; without replay the
same run shows the gap."""

from __future__ import annotations

import pytest

from train_utils import read_metrics, run_train

ENGINES = [
    "rollout.engine=sglang",
    "rollout.engine_server=cpu",
    "rollout.sync_mode=disaggregated",
    "rollout.num_engines=1",
    "train.steps=2",
]
NO_PROBE = ["rollout.sync_verify=false"]  # without r3 the probe compares each side's own routing: it would fail


@pytest.fixture
def perturbed(monkeypatch):
    from gspo_megatron.cpu_server.args import PERTURBATION_ENV

    monkeypatch.setenv(PERTURBATION_ENV, "3.0")


R3 = [
    *ENGINES,
    "rollout.routing_replay=r3",
    "parallel.max_tokens_per_micro_batch=64",
    "rollout.sync_verify_every=1",
    "gspo.kl_coef=0.01",
    "rollout.engine_deterministic=true",  # per-sample seeds: a second run samples the same (recompute test)
]


@pytest.fixture(scope="module")
def r3_rows(tmp_path_factory) -> list[dict]:
    """The metrics of the r3 run (perturbed engines); shared by the tests below."""
    from gspo_megatron.cpu_server.args import PERTURBATION_ENV

    out = str(tmp_path_factory.mktemp("r3"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PERTURBATION_ENV, "3.0")
        run_train(out, R3)
    return read_metrics(out)


def test_r3_run_closes_the_logprob_gap(tmp_path, perturbed, r3_rows):
    # the post-sync probe (rollout.sync_verify, every sync) replays the engine's routes too: it passes
    rows = r3_rows
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_abs_diff"] < 1e-5, r
        assert 0.0 < r["rollout/route_agreement"] < 1.0, r
        assert r["sync/verify_max_abs_diff"] < 1e-4, r
    run_train(str(tmp_path / "off"), [*ENGINES, *NO_PROBE])
    off = read_metrics(str(tmp_path / "off"))
    assert all(r["rollout/logprob_abs_diff"] > 1e-3 for r in off), off
    assert all("rollout/route_agreement" not in r for r in off)


def test_r3_run_with_recompute_learns_as_without(tmp_path, perturbed, r3_rows):
    """model.recompute=true (issue 32): the layers recomputed in backward replay the same routes, so
    the run learns exactly as the one without recompute (same seed: same samples, same updates)."""
    run_train(str(tmp_path / "rc"), [*R3, "model.recompute=true"])
    rows = read_metrics(str(tmp_path / "rc"))
    assert [r["step"] for r in rows] == [1, 2]
    for r, ref in zip(rows, r3_rows):
        assert r["rollout/logprob_abs_diff"] < 1e-5, r
        assert r["sync/verify_max_abs_diff"] < 1e-4, r
        keys = [k for k in ref if k.startswith(("loss/", "reward/", "train/grad_norm")) and isinstance(ref[k], float)]
        assert keys, ref
        for k in keys:
            assert r[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-6), (r["step"], k)


def test_r2_run(tmp_path):
    """R2 with any engine (here the default one): two mini-batches (the second policy forward runs
    after an update, replaying the old forward's record), the KL reference model replaying it too."""
    run_train(
        str(tmp_path / "r2"), ["train.steps=2", "rollout.routing_replay=r2", "gspo.mini_batches=2", "gspo.kl_coef=0.01"]
    )
    rows = read_metrics(str(tmp_path / "r2"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(v == v for v in r.values() if isinstance(v, float)), r  # no NaN
        assert "rollout/route_agreement" not in r  # r2 has no engine routes to compare with


HOOK = """
from gspo_megatron.engines.custom import Trajectory


def two_turns(generate, sample):
    traj = Trajectory()
    first = generate(sample.prompt_ids, max_new_tokens=3)
    traj.add_policy(first)
    traj.add_env([7, 8, 9])  # a tool's output: not trained, routed by the next call's prefill
    second = generate(list(sample.prompt_ids) + traj.response_ids, max_new_tokens=3)
    traj.add_policy(second)
    traj.add_env([11, 12])  # a final tool turn no call ran: the trainer routes it
    return traj.result(reward=float(first.response_ids[0] % 2))
"""


def test_r3_multi_turn_custom_rollouts(tmp_path, perturbed):
    """Two policy turns around a tool's output, then a trailing tool turn: every token the engine ran
    carries its route, so the trained tokens' old log-probs equal the engine's; the probe replays too."""
    hook = tmp_path / "hook.py"
    hook.write_text(HOOK)
    run_train(
        str(tmp_path / "mt"),
        [
            *ENGINES,
            "rollout.routing_replay=r3",
            f"rollout.custom_function={hook}:two_turns",
            "parallel.max_tokens_per_micro_batch=64",
        ],
    )
    rows = read_metrics(str(tmp_path / "mt"))
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_abs_diff"] < 1e-5, r
        assert 0.0 < r["rollout/route_agreement"] < 1.0, r
        assert 0.0 < r["rollout/trained_token_frac"] < 1.0, r  # tool output was in the sequences
        assert r["rollout/generate_calls_mean"] == 2.0, r
