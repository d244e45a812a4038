import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reward_server_faults import serve  # noqa: E402,F401 - the fault-injecting reward server fixture


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU node)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
