"""Group z-score advantages and zero-variance (dynamic sampling) filtering against a plain-Python reference."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.losses import group_advantages


def py_zscore(rewards: list[float], normalize_std: bool, eps: float, unbiased: bool) -> list[float]:
    g = len(rewards)
    mean = sum(rewards) / g
    var = sum((r - mean) ** 2 for r in rewards) / ((g - 1) if unbiased else g)
    if max(rewards) == min(rewards):
        return [0.0] * g
    return [(r - mean) / (math.sqrt(var) + eps) if normalize_std else r - mean for r in rewards]


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("unbiased", [True, False])
def test_matches_reference(normalize_std, unbiased):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 2.0, 0.25])
    out = group_advantages(rewards, 4, normalize_std=normalize_std, eps=1e-4, unbiased_std=unbiased)
    expected = []
    for i in range(3):
        expected += py_zscore(rewards[4 * i : 4 * i + 4].tolist(), normalize_std, 1e-4, unbiased)
    torch.testing.assert_close(out.advantages, torch.tensor(expected), rtol=1e-6, atol=1e-7)
    assert out.zero_variance.tolist() == [False, True, False]
    assert out.num_zero_variance == 1 and out.zero_variance_fraction == pytest.approx(1 / 3)


def test_2d_input_and_filtering():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [2.0, 2.0]])
    out = group_advantages(rewards, 2)
    assert out.advantages.shape == (6,)
    assert out.keep_mask().tolist() == [False, False, True, True, False, False]
    assert out.keep_indices().tolist() == [2, 3]
    assert out.advantages[[0, 1, 4, 5]].abs().sum() == 0
    # z-scores of a non-degenerate group sum to zero and have unit std (up to eps)
    kept = out.advantages[2:4]
    assert kept.sum().abs() < 1e-6 and kept.std().item() == pytest.approx(1.0, rel=1e-4)
