"""Check a config against a cluster shape and print the layout and per-GPU memory estimate.

    python tools/plan.py --config configs/qwen3_30b_a3b_gspo.yaml --nodes 2 --gpus-per-node 8 \
        --gpu-memory-gb 80 [section.key=value ...]

Exit status: 0 fits, 1 does not fit in GPU memory, 2 invalid config or layout.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from gspo_megatron.plan_report import plan_main

if __name__ == "__main__":
    sys.exit(plan_main())
