"""Bad input to the loss package: clear errors naming the argument; an empty mask gives a zero loss."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.losses import (
    PolicyLossConfig,
    group_advantages,
    policy_loss,
    policy_loss_flat,
    seq_index_from_cu_seqlens,
    vocab_parallel_logprobs,
)


def batch(b=3, t=4):
    lp = torch.randn(b, t).requires_grad_(True)
    return lp, lp.detach() + 0.01, torch.randn(b), torch.ones(b, t)


@pytest.mark.parametrize("name", ["old_logprobs", "response_mask"])
def test_shape_mismatch_names_argument(name):
    lp, old, adv, mask = batch()
    args = {"old_logprobs": old, "response_mask": mask}
    args[name] = args[name][:, :3]
    with pytest.raises(ValueError, match=name):
        policy_loss(lp, args["old_logprobs"], adv, args["response_mask"])


def test_optional_shape_mismatch_names_argument():
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, old, adv, mask, ref_logprobs=old[:2], kl_coef=0.1)
    with pytest.raises(ValueError, match="logprobs"):
        policy_loss(lp[0], old, adv, mask)


def test_advantages_shape():
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, old, adv[:2], mask)
    with pytest.raises(ValueError, match="advantages.*gspo"):
        policy_loss(lp, old, torch.randn(3, 4), mask, mode="gspo")
    with pytest.raises(ValueError, match="advantages"):
        policy_loss_flat(
            lp.reshape(-1),
            old.reshape(-1),
            torch.randn(5),
            mask.reshape(-1),
            torch.zeros(12, dtype=torch.long),
            3,
            PolicyLossConfig(),
        )


@pytest.mark.parametrize("mode", ["gspo", "gspo_token", "grpo"])
def test_empty_mask_gives_zero_loss_and_metric(mode):
    lp, old, adv, mask = batch()
    loss, metrics = policy_loss(lp, old, adv, torch.zeros_like(mask), mode=mode)
    assert loss.item() == 0.0
    assert metrics["empty_mask"] == 1.0 and metrics["num_seqs"] == 0.0
    loss.backward()  # still part of the graph, so Megatron's backward step works
    assert torch.equal(lp.grad, torch.zeros_like(lp))
    loss, metrics = policy_loss(lp, old, adv, torch.zeros_like(mask), mode=mode, normalizer=10)
    assert loss.item() == 0.0 and metrics["empty_mask"] == 1.0


@pytest.mark.parametrize(
    "name", ["logprobs", "old_logprobs", "advantages", "ref_logprobs", "engine_logprobs", "entropy"]
)
def test_non_finite_input_names_argument(name):
    lp, old, adv, mask = batch()
    inputs = {
        "logprobs": lp.detach().clone(),
        "old_logprobs": old.clone(),
        "advantages": adv.clone(),
        "ref_logprobs": old.clone(),
        "engine_logprobs": old.clone(),
        "entropy": torch.ones(3, 4),
    }
    inputs[name].view(-1)[1] = float("nan") if name != "old_logprobs" else float("-inf")
    with pytest.raises(ValueError, match=f"non-finite.*{name}"):
        policy_loss(
            inputs["logprobs"],
            inputs["old_logprobs"],
            inputs["advantages"],
            mask,
            ref_logprobs=inputs["ref_logprobs"],
            kl_coef=0.1,
            engine_logprobs=inputs["engine_logprobs"],
            tis_cap=2.0,
            entropy=inputs["entropy"],
            entropy_coef=0.01,
        )


def test_non_finite_off_the_response_is_ignored():
    lp, old, adv, mask = batch()
    mask[0, 3] = 0
    old = old.clone()
    old[0, 3] = float("nan")
    ref_lp = lp.detach().clone()
    ref_lp[0, 3] = float("-inf")
    loss, _ = policy_loss(lp, old, adv, mask, ref_logprobs=ref_lp, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"clip_low": 0.0}, "clip_low"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": 0.0}, "clip_high"),
        ({"clip_high": -1.0}, "clip_high"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": float("nan")}, "clip_high"),
        ({"mode": "ppo"}, "mode"),
        ({"kl_estimator": "k4"}, "kl_estimator"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"aggregation": "token-sum"}, "aggregation"),
    ],
)
def test_bad_config_names_field(kw, name):
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match=name):
        policy_loss(lp, old, adv, mask, **kw)


def test_token_sum_with_sequence_ratio_refused():
    with pytest.raises(ValueError, match="aggregation='token-mean'.*gspo"):
        PolicyLossConfig(mode="gspo", aggregation="token-mean")
    PolicyLossConfig(mode="grpo", aggregation="token-mean")  # fine for a token ratio


def test_missing_companion_inputs():
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, old, adv, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="engine_logprobs"):
        policy_loss(lp, old, adv, mask, tis_cap=2.0)


@pytest.mark.parametrize("normalizer", [0, -3, float("inf")])
def test_bad_normalizer(normalizer):
    lp, old, adv, mask = batch()
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(lp, old, adv, mask, normalizer=normalizer)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(lp, old, adv, mask, normalizer=torch.tensor(float(normalizer)))


def test_vocab_parallel_bad_input():
    with pytest.raises(ValueError, match="targets"):
        vocab_parallel_logprobs(torch.randn(4, 10), torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="targets"):
        vocab_parallel_logprobs(torch.randn(4, 10), torch.zeros(4))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprobs(torch.randn(4, 10), torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        vocab_parallel_logprobs(torch.randn(4, 10), torch.zeros(4, dtype=torch.long), chunk_size=0)


def test_advantages_bad_input():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.randn(7), 4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.randn(3, 5), 4)
    with pytest.raises(ValueError, match=r"rewards\[2\]"):
        group_advantages(torch.tensor([1.0, 0.0, float("nan"), 1.0]), 2)


def test_cu_seqlens_bad_input():
    with pytest.raises(ValueError, match="cu_seqlens"):
        seq_index_from_cu_seqlens(torch.tensor([0, 5, 3]), 8)
    with pytest.raises(ValueError, match="total_tokens"):
        seq_index_from_cu_seqlens(torch.tensor([0, 5, 9]), 8)
