# GPU image for gspo-megatron: NGC PyTorch (CUDA, NCCL, cuDNN, Transformer Engine, apex) + SGLang.
#   docker build -t gspo-megatron .
#   docker run --gpus all --ipc=host --shm-size=32g -v $PWD/runs:/workspace/gspo/runs gspo-megatron \
#       launch/torchrun.sh configs/qwen3_30b_a3b_gspo.yaml
# --ipc=host is required for CUDA IPC weight sync (colocated mode) between trainer and engines.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.06-py3
FROM ${BASE_IMAGE}

ARG SGLANG_VERSION=0.5.23
ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0

# Keep the image's torch / Transformer Engine / apex: install SGLang and the router without letting
# pip replace torch (constraint pins the preinstalled version).
RUN python -c "import torch, transformer_engine; print(torch.__version__, transformer_engine.__version__)" \
 && python -c "import torch; print('torch==' + torch.__version__)" > /tmp/constraints.txt \
 && pip install -c /tmp/constraints.txt "sglang[srt]==${SGLANG_VERSION}" sglang-router nvidia-ml-py \
 && apt-get update && apt-get install -y --no-install-recommends procps shellcheck \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/gspo
COPY . /workspace/gspo
# pyproject pins torch==2.13.0 / transformers for the CPU CI; in this image the NGC torch and the
# transformers that SGLang pins win, so the package goes in with --no-deps plus its other deps.
RUN pip install -c /tmp/constraints.txt "megatron-core>=0.16.1,<0.20" pyyaml rich tqdm tensorboard \
        pyarrow math-verify \
 && pip install --no-deps -e .

# launch/torchrun.sh uses `torchrun` from PATH when there is no .venv
CMD ["bash"]
