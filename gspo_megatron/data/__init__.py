"""Prompt datasets, the demo byte-level tokenizer and built-in tasks.

Submodules are imported lazily so that light users (the reward workers import ``tasks``) do not pay
for importing transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DatasetError": "dataset",
    "PromptDataset": "dataset",
    "PromptRow": "dataset",
    "PromptSampler": "dataset",
    "decode_response": "dataset",
    "format_prompt": "dataset",
    "TASKS": "tasks",
    "Task": "tasks",
    "get_task": "tasks",
    "shaped_integer_reward": "answer_reward",
    "build_demo_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "padded_vocab_size": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
