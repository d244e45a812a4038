"""The same seed trains to the same losses in one rank and in parallel layouts (fp32 tolerance)."""

import pytest

from train_utils import read_metrics, run_train

KEYS = ("loss/total", "gspo/ratio_mean", "reward/mean", "rollout/logprob_abs_diff")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single"))
    run_train(out, [])
    return read_metrics(out)


def test_single_rank_run_is_exactly_synced(single):
    assert [m["step"] for m in single] == [1, 2, 3]
    for m in single:
        # fp32 on CPU: the engine's log-probs equal the trainer's up to float rounding
        assert m["rollout/logprob_abs_diff"] < 1e-5
        assert m["train/skipped_updates"] == 0


@pytest.mark.parametrize("layout", [["parallel.ep=2"], ["parallel.tp=2"]], ids=["ep2", "tp2"])
def test_parallel_layout_matches_single_rank(tmp_path, single, layout):
    run_train(str(tmp_path), layout, nproc=2)
    multi = read_metrics(str(tmp_path))
    assert len(multi) == len(single)
    for a, b in zip(single, multi):
        assert a["reward/mean"] == b["reward/mean"]  # identical rollouts
        for k in ("loss/total", "gspo/ratio_mean", "train/grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (k, a["step"])


def test_unfused_logprob_head_matches_fused(tmp_path, single):
    """model.fused_logprobs=false (GPTModel's logits, chunked softmax) trains to the same metrics as
    the default fused head (hidden states + output weight)."""
    run_train(str(tmp_path), ["model.fused_logprobs=false"])
    plain = read_metrics(str(tmp_path))
    assert len(plain) == len(single)
    for a, b in zip(single, plain):
        assert a["reward/mean"] == b["reward/mean"]
        for k in ("loss/total", "gspo/ratio_mean", "train/grad_norm", "policy/entropy"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (k, a["step"])
