"""A training run with sequence packing (parallel.max_tokens_per_micro_batch) gives the metrics of
the padded run with the same seed, up to float noise: on one rank, and with ep2 (two data-parallel
replicas, sequences balanced over them by tokens). perf/padding_frac is logged every step in both
modes and is never higher when packing."""

import pytest

from train_utils import read_metrics, run_train

KEYS = ("loss/total", "loss/policy", "gspo/ratio_mean", "train/grad_norm", "policy/entropy")


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("padded"))
    run_train(out, [])
    return read_metrics(out)


def _compare(padded, packed):
    assert [m["step"] for m in packed] == [m["step"] for m in padded] == [1, 2, 3]
    for a, b in zip(padded, packed):
        assert a["reward/mean"] == b["reward/mean"]  # identical rollouts
        for k in KEYS:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (k, a["step"])
        # (the demo's prompts and 3-token responses are nearly equal in length: little to pad)
        assert 0 <= b["perf/padding_frac"] <= a["perf/padding_frac"] < 1


def test_packed_run_matches_padded(tmp_path, padded):
    run_train(str(tmp_path), ["parallel.max_tokens_per_micro_batch=64"])
    _compare(padded, read_metrics(str(tmp_path)))


def test_packed_ep2_dp2_run_matches_padded(tmp_path, padded):
    run_train(str(tmp_path), ["parallel.max_tokens_per_micro_batch=64", "parallel.ep=2"], nproc=2)
    _compare(padded, read_metrics(str(tmp_path)))
