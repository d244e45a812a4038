"""GSPO / GSPO-token / GRPO losses, group advantages, vocab-parallel log-probs and the Megatron loss function.

from gspo_megatron.losses import policy_loss
loss, metrics = policy_loss(logprobs, old_logprobs, advantages, response_mask, mode="gspo")
"""

from gspo_megatron.losses.advantages import GroupAdvantages, group_advantages
from gspo_megatron.losses.megatron_loss import (
    check_megatron_config,
    make_megatron_logprob_func,
    make_megatron_loss_func,
)
from gspo_megatron.losses.objectives import ObjectiveTerms, policy_loss_modes, register_policy_loss
from gspo_megatron.losses.policy_loss import (
    PolicyLossConfig,
    PolicyLossOutput,
    kl_estimate,
    policy_loss,
    policy_loss_flat,
)
from gspo_megatron.losses.reductions import seq_index_for_rows, seq_index_from_cu_seqlens
from gspo_megatron.losses.vocab_parallel import vocab_parallel_logprobs

__all__ = [
    "GroupAdvantages",
    "ObjectiveTerms",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "check_megatron_config",
    "group_advantages",
    "kl_estimate",
    "make_megatron_logprob_func",
    "make_megatron_loss_func",
    "policy_loss",
    "policy_loss_modes",
    "policy_loss_flat",
    "register_policy_loss",
    "seq_index_for_rows",
    "seq_index_from_cu_seqlens",
    "vocab_parallel_logprobs",
]
