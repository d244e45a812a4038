"""The policy-loss registry (losses/objectives.py): modes are registered by decorator, the config's
gspo.mode is checked against the registry, and a mode registered outside the package runs end to end."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.config import load_config
from gspo_megatron.errors import ConfigError
from gspo_megatron.losses import objectives
from gspo_megatron.losses.objectives import ObjectiveTerms, policy_loss_modes, register_policy_loss
from gspo_megatron.losses.policy_loss import PolicyLossConfig, policy_loss
from gspo_megatron.trainer.step import loss_config


@pytest.fixture
def registry():
    """The registry, restored after the test: what it registers is gone afterwards."""
    saved = dict(objectives.POLICY_LOSSES)
    yield objectives.POLICY_LOSSES
    objectives.POLICY_LOSSES.clear()
    objectives.POLICY_LOSSES.update(saved)


def test_builtin_modes_in_order():
    assert policy_loss_modes()[:3] == ("gspo", "gspo_token", "grpo")


def test_unknown_mode_is_refused_in_one_line_naming_field_and_modes():
    with pytest.raises(ValueError) as e:
        PolicyLossConfig(mode="ppo")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("mode must be one of 'gspo', 'gspo_token', 'grpo'; got 'ppo'")
    with pytest.raises(ConfigError) as c:
        load_config(None, ["gspo.mode=ppo"])
    assert c.value.errors == ["gspo.mode must be one of 'gspo', 'gspo_token', 'grpo'; got 'ppo'"]


def test_duplicate_registration_refused(registry):
    with pytest.raises(ValueError, match="'gspo' is already registered"):
        register_policy_loss("gspo", default_clip=(0.1, 0.1))(lambda x, lo, hi: ObjectiveTerms(x.lp.sum()))


def test_a_registered_loss_runs_from_the_config(registry):
    """J = sum_t tok_w_t r_t A_t (no clip): registered here, chosen by gspo.mode, clip defaults from its spec."""

    @register_policy_loss("plain_pg", default_clip=(0.3, 0.5), config_token_mean=True)
    def plain_pg(x, clip_low, clip_high):
        return ObjectiveTerms(
            (x.tok_w * torch.exp(x.delta) * x.adv_tok).sum(), cut_tok=torch.zeros_like(x.seq, dtype=torch.bool)
        )

    cfg = load_config(None, ["gspo.mode=plain_pg", "gspo.loss_agg=token-mean"])
    assert (cfg.gspo.clip_low, cfg.gspo.clip_high) == (0.3, 0.5)
    lc = loss_config(cfg)
    assert (lc.mode, lc.aggregation, lc.clip_low) == ("plain_pg", "token-mean", 0.3)
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() + 0.1
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, metrics = policy_loss(lp, old, adv, mask, mode=lc.mode, aggregation=lc.aggregation)
    want = -(torch.exp(torch.tensor(-0.1, dtype=torch.float64)) * (2 * 1.0 + 3 * -2.0)) / 5
    torch.testing.assert_close(loss.detach(), want)
    loss.backward()
    torch.testing.assert_close(lp.grad, -torch.exp(torch.tensor(-0.1, dtype=torch.float64)) * mask * adv[:, None] / 5)
    assert metrics["clip_fraction"] == 0.0
    # the config's rule for token-mean follows the spec: a mode without config_token_mean refuses it
    register_policy_loss("plain_pg_seq", default_clip=(0.3, 0.5))(plain_pg)
    with pytest.raises(ConfigError, match="gspo.loss_agg=token-mean is not allowed with gspo.mode=plain_pg_seq"):
        load_config(None, ["gspo.mode=plain_pg_seq", "gspo.loss_agg=token-mean"])


def test_sequence_ratio_property_refuses_token_advantages(registry):
    register_policy_loss("seq_copy", default_clip=(1e-3, 1e-3), sequence_ratio=True)(
        objectives.POLICY_LOSSES["gspo"].fn
    )
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages must be \\[B\\] for mode='seq_copy'"):
        policy_loss(lp, lp, torch.zeros(2, 3), torch.ones(2, 3), mode="seq_copy")
    with pytest.raises(ValueError, match="aggregation='token-mean'.*seq_copy"):
        PolicyLossConfig(mode="seq_copy", aggregation="token-mean")
