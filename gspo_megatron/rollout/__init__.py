"""Rollout engines: the interface, the CPU transformers engine, and the SGLang engine (GPU)."""

from gspo_megatron.rollout.base import RolloutEngine, RolloutSample, SamplingParams

__all__ = ["RolloutEngine", "RolloutSample", "SamplingParams"]
