#!/usr/bin/env bash
# Run the CPU test suite against the latest megatron-core 0.19.x (forward compatibility only: the
# GPU image and .venv run the pinned megatron-core==0.16.1, pyproject.toml / tests/test_gpu_pins.py;
# 0.19.x e.g. dropped the legacy GroupedMLP, which models/build.py now looks up by name).
# megatron-core 0.17+ declares Requires-Python >= 3.12; on 3.11 it is installed with
# --ignore-requires-python and needs triton. Uses its own venv so .venv keeps the pinned 0.16.1.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-mcore-latest}
PYTHON=${PYTHON:-python3}
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -e ".[test]"
"$VENV/bin/pip" install -q --ignore-requires-python "megatron-core>=0.19,<0.20" triton psutil
"$VENV/bin/python" -c "import megatron.core as m; print('megatron-core', m.__version__)"
"$VENV/bin/pytest" -q tests "$@"
