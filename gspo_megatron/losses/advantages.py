"""Group-relative advantages (GRPO / GSPO) and dynamic-sampling filtering of zero-variance groups.

Rewards of one rollout batch are laid out group by group: [num_groups * group_size] (the G responses
of a prompt are adjacent) or [num_groups, group_size]. Runs on any rank; no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GroupAdvantages:
    """Result of :func:`group_advantages`.

    advantages: [num_groups * group_size] fp32, one per sequence, in the input order.
    zero_variance: [num_groups] bool, groups whose rewards are all equal (no signal; advantages 0).
    group_mean, group_std: [num_groups] fp32 reward statistics.
    """

    advantages: Tensor
    zero_variance: Tensor
    group_mean: Tensor
    group_std: Tensor

    @property
    def num_zero_variance(self) -> int:
        return int(self.zero_variance.sum())

    @property
    def zero_variance_fraction(self) -> float:
        return float(self.zero_variance.float().mean())

    def keep_mask(self) -> Tensor:
        """[num_groups * group_size] bool: sequences of groups that carry signal (dynamic sampling)."""
        group_size = self.advantages.numel() // self.zero_variance.numel()
        return (~self.zero_variance).repeat_interleave(group_size)

    def keep_indices(self) -> Tensor:
        """Indices of the sequences to keep when zero-variance groups are filtered out."""
        return self.keep_mask().nonzero().squeeze(1)


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> GroupAdvantages:
    """Group z-score: A_i = (r_i - mean_group r) / (std_group r + eps), or r_i - mean if not ``normalize_std``.

    Args:
        rewards: [num_groups * group_size] or [num_groups, group_size], finite.
        group_size: G, responses per prompt (>= 2 for a standard deviation).
        normalize_std: divide by the group standard deviation (Dr. GRPO turns this off).
        eps: added to the standard deviation.
        unbiased_std: Bessel-corrected std (torch.std's default, as TRL and verl use).
    A group whose rewards are all exactly equal gets advantages exactly 0 and is flagged in
    ``zero_variance``.
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if normalize_std and unbiased_std and group_size < 2:
        raise ValueError("group_size must be >= 2 to normalize by an unbiased group std")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if rewards.dim() == 2:
        if rewards.shape[1] != group_size:
            raise ValueError(
                f"rewards has shape {tuple(rewards.shape)} but group_size={group_size} "
                "(expected [num_groups, group_size])"
            )
    elif rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards must be [num_groups * group_size] or [num_groups, group_size]; got shape "
            f"{tuple(rewards.shape)} with group_size={group_size}"
        )
    if rewards.numel() == 0:
        raise ValueError("rewards is empty")
    r = rewards.detach().float().reshape(-1, group_size)
    if not bool(torch.isfinite(r).all()):
        bad = int((~torch.isfinite(r)).reshape(-1).nonzero()[0].item())
        raise ValueError(f"rewards must be finite; rewards[{bad}] = {r.reshape(-1)[bad].item()}")
    mean = r.mean(dim=1)
    std = r.std(dim=1, unbiased=unbiased_std) if group_size > 1 else torch.zeros_like(mean)
    zero_var = r.amax(dim=1) == r.amin(dim=1)
    centered = r - mean[:, None]
    adv = centered / (std[:, None] + eps) if normalize_std else centered
    adv = torch.where(zero_var[:, None], torch.zeros_like(adv), adv)
    return GroupAdvantages(advantages=adv.reshape(-1), zero_variance=zero_var, group_mean=mean, group_std=std)
