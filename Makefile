# Two commands do everything on a fresh machine (Python 3.11+):
#   make demo   - create .venv if missing, install, run the CPU GSPO demo
#   make test   - create .venv if missing, install, run the CPU test suite
#   make lint   - ruff check, ruff format --check, then mypy on the package (CI runs it before the tests)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint test-all test-mcore-latest clean-venv bench

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gspo-train --config configs/demo_cpu.yaml $(ARGS)

# The suite on TEST_JOBS pytest-xdist workers (one test file per work unit; the long files start
# first, see tests/conftest.py). Many tests wait on subprocesses and servers, so 2 workers keep 2
# cores busy; TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2
XDIST = -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder --durations=25

test: $(STAMP)
	$(VENV)/bin/pytest -q $(XDIST) tests $(ARGS)

# ruff: pyflakes, pycodestyle, import order (rules in pyproject.toml; also a pre-commit hook);
# mypy: the type checker on gspo_megatron/ (its settings: [tool.mypy] in pyproject.toml)
lint: $(STAMP)
	$(VENV)/bin/ruff check gspo_megatron tests tools bench
	$(VENV)/bin/ruff format --check gspo_megatron tests tools bench
	$(VENV)/bin/mypy

# Everything, slow tests included.
test-all: $(STAMP)
	$(VENV)/bin/pytest -q $(XDIST) tests -m "not gpu" $(ARGS)

# Forward compatibility only: the CPU suite against the latest megatron-core 0.19.x in a separate venv
# (0.17+ declares Python >= 3.12; on 3.11 it is forced with --ignore-requires-python and needs triton).
# Not what the GPU image runs: pyproject pins megatron-core==0.16.1 everywhere (tests/test_gpu_pins.py).
test-mcore-latest:
	bash tools/test_mcore_latest.sh

bench: $(STAMP)
	$(PY) bench/logprobs.py && $(PY) bench/convert.py && $(PY) bench/train_step.py

clean-venv:
	rm -rf $(VENV)
