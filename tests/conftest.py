import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reward_server_faults import serve  # noqa: E402,F401 - the fault-injecting reward server fixture

# The files that take longest (seconds on 2 cores, serial run), longest first. `make test` runs the
# suite on 2 pytest-xdist workers, one file per work unit (--dist loadfile): starting the long files
# first keeps one worker from finishing minutes after the other. Only the order changes.
LONG_FILES = ("train/test_demo.py", "topology/test_multinode.py", "models/test_hf_config_spellings.py",
              "train/test_bad_input.py", "train/test_faults.py", "train/test_run_paths.py",
              "train/test_offpolicy.py", "models/test_equivalence.py", "train/test_user_task.py",
              "train/test_train_layouts.py", "tools/test_conversion_split.py", "train/test_no_orphans.py",
              "train/test_tool_calc_run.py", "train/test_eval_run.py")


def _long_file_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_long_file_rank)  # stable: the rest keep their order
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
