"""Reward functions (math, exact match, built-in tasks, user files) and the timeout-safe runner."""

from gspo_megatron.rewards.builtin import exact_match_reward, math_reward, normalize_answer
from gspo_megatron.rewards.registry import get_reward_fn
from gspo_megatron.rewards.runner import RewardRunner

__all__ = [
    "RewardRunner",
    "exact_match_reward",
    "get_reward_fn",
    "math_reward",
    "normalize_answer",
]
