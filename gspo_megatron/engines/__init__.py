"""Rollout engines: the interface, the CPU transformers engine (optionally in a child process), and
the SGLang engine (GPU). Engines are imported lazily: ``from gspo_megatron.engines import X``."""

from gspo_megatron.engines.base import RolloutEngine, RolloutSample, SamplingParams

_LAZY = {
    "HFRolloutEngine": "gspo_megatron.engines.hf_engine",
    "SubprocessRolloutEngine": "gspo_megatron.engines.subprocess_engine",
    "EngineDiedError": "gspo_megatron.engines.subprocess_engine",
    "SGLangRolloutEngine": "gspo_megatron.engines.sglang_engine",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = ["RolloutEngine", "RolloutSample", "SamplingParams", *_LAZY]
