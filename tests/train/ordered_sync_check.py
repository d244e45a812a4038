"""Launcher of tests/train/test_sync_delta_run.py (torchrun runs this file): gspo-train with
tests/topology/sync_check.py's bitwise check after every sync, and rank 0's SGLang engine sending one
request at a time (``max_concurrency=1``). With two engines serving concurrent requests, the groups
reach the batch in completion order (orchestration/batch.py streams them), which varies from run to run;
one request at a time makes that order the prompts' order, so two runs with one seed are comparable."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "topology"))

if __name__ == "__main__":
    from gspo_megatron.engines import sglang_engine
    from gspo_megatron.train import main
    from sync_check import check

    init = sglang_engine.SGLangRolloutEngine.__init__

    def one_at_a_time(self, *a, **k):
        init(self, *a, **dict(k, max_concurrency=1))

    sglang_engine.SGLangRolloutEngine.__init__ = one_at_a_time
    sys.exit(main(sys.argv[1:], after_sync=check))
