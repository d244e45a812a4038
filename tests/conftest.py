import os
import sys

# One intra-op thread in every test process, the processes they start (gspo-train, servers, spawned
# ranks) inheriting it: `make test` runs 2 workers on 2 cores, and each process's default of one thread
# per core oversubscribes them (tiny tensors gain nothing from threads; OpenMP's spinning costs).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from reward_server_faults import serve  # noqa: F401 - the fault-injecting reward server fixture
from tiny_models import write_tiny_hf_checkpoint  # the tiny-model factory (tests/tiny_models.py)

# The files that take longest (seconds on 2 cores, serial run), longest first. `make test` runs the
# suite on 2 pytest-xdist workers, one file per work unit (--dist loadfile): starting the long files
# first keeps one worker from finishing minutes after the other. Only the order changes.
LONG_FILES = (
    "train/test_family_runs.py",
    "train/test_distill_run.py",
    "train/test_bench_distill.py",
    "train/test_demo.py",
    "train/test_speculative_run.py",
    "topology/test_multinode.py",
    "train/test_lora_adapter_run.py",
    "train/test_sync_delta_run.py",
    "train/test_sync_owner_direct_run.py",
    "train/test_sync_delta_disaggregated_run.py",
    "models/test_equivalence.py",
    "models/test_glm_moe_dsa.py",
    "models/test_mtp_model.py",
    "train/test_qwen3_5_vl_run.py",
    "models/test_deepseek_v3_te.py",
    "models/test_dsa_te.py",
    "models/test_lora_te.py",
    "models/test_hf_config_spellings.py",
    "train/test_run_paths.py",
    "train/test_route_replay_run.py",
    "rollout/test_sglang_loaders.py",
    "train/test_indexer_replay_run.py",
    "train/test_bad_input.py",
    "train/test_faults.py",
    "train/test_offpolicy.py",
    "train/test_user_task.py",
    "train/test_train_layouts.py",
    "tools/test_conversion_split.py",
    "train/test_no_orphans.py",
    "train/test_tool_calc_run.py",
    "train/test_eval_run.py",
)


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """``tiny_hf_checkpoint(family, seed=0, subdir="hf", **overrides) -> (directory, transformers model)``:
    the family's tiny model saved by transformers in a fresh temporary directory (tests/tiny_models.py)."""

    def make(family: str, seed: int = 0, subdir: str = "hf", **overrides):
        return write_tiny_hf_checkpoint(tmp_path_factory.mktemp(family), family, seed, subdir, **overrides)

    return make


def _long_file_rank(item) -> int:
    path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
    return LONG_FILES.index(path) if path in LONG_FILES else len(LONG_FILES)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_long_file_rank)  # stable: the rest keep their order
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken CUDA install counts as no GPU here
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU node)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
