# GPU image for gspo-megatron: one Python 3.12 environment holding SGLang 0.5.23 (its torch 2.14.1 /
# CUDA 13 wheels), Transformer Engine 2.20.2 (built against that torch), megatron-core 0.16.1 (the
# version the CPU suite runs; tests/test_gpu_pins.py keeps the `gpu` extra's pins exact) and this package.
#   docker build -t gspo-megatron .
#   docker run --gpus all --ipc=host --shm-size=32g -v $PWD/runs:/workspace/gspo/runs gspo-megatron \
#       launch/torchrun.sh configs/qwen3_30b_a3b_gspo.yaml
# --ipc=host is required for CUDA IPC weight sync (colocated mode) between trainer and engines.
#
# Why one environment on a CUDA devel base and not the NGC PyTorch image: sglang 0.5.23 pins
# torch==2.14.1, transformers==5.19.0 and flashinfer 0.7.2 exactly, so it cannot share the NGC image's
# torch; trainer and engines in one environment use one torch and one NCCL, which CUDA IPC handles and
# the NCCL weight-update group between them need. The list pip resolves is pyproject.toml's `gpu`
# extra (its dry run is in docs/gpu.md); the package itself goes in with --no-deps because its core
# pins (torch 2.13.0, transformers 5.23.0) are the CPU CI's.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

# Ubuntu 24.04's Python is 3.12 (sglang's cp312 wheels; megatron-core 0.16.1 has a cp312 wheel too)
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv python3.12-dev git procps \
        shellcheck build-essential cmake ninja-build \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv /opt/venv \
 && pip install --upgrade pip

WORKDIR /workspace/gspo
COPY pyproject.toml /workspace/gspo/pyproject.toml
# 1) the GPU environment: pyproject's `gpu` extra, one resolve
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['gpu']))" \
        > /tmp/requirements-gpu.txt \
 && pip install -r /tmp/requirements-gpu.txt
# 2) Transformer Engine's PyTorch extension is published as source only: build it against the torch
#    installed above (same version as the transformer_engine core wheel; needs nvcc + cuDNN headers).
RUN TE_VERSION=$(python -c "import importlib.metadata as m; print(m.version('transformer_engine'))") \
 && NVTE_FRAMEWORK=pytorch MAX_JOBS=${MAX_JOBS:-8} \
        pip install --no-build-isolation "transformer_engine_torch==${TE_VERSION}" \
 && python -c "import torch, importlib.metadata as m; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'sglang', m.version('sglang'), 'transformer_engine_torch', m.version('transformer_engine_torch'), \
'megatron-core', m.version('megatron-core'), 'transformers', m.version('transformers'))"

COPY . /workspace/gspo
RUN pip install --no-deps -e .

# launch/torchrun.sh uses `torchrun` from PATH when there is no .venv
CMD ["bash"]
