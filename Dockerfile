# rlhfkit on a CUDA machine:
#   docker build -t rlhfkit .
#   docker run --gpus all --ipc=host --rm -it -v $PWD:/workspace rlhfkit rlhfkit quickstart
# torch comes from PyPI (its Linux wheels bundle the CUDA libraries); the base image supplies the
# CUDA user-space driver hooks and a compiler for Triton's kernels. EXTRAS picks rlhfkit's extras
# (add vllm for vLLM engines).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --upgrade pip

ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"

WORKDIR /opt/rlhfkit
COPY pyproject.toml README.md LICENSE ./
COPY rlhfkit ./rlhfkit
ARG EXTRAS=ray,serve,peft,datasets,tensorboard,wandb,math,openai
RUN pip install ".[${EXTRAS}]" && rlhfkit --help > /dev/null

WORKDIR /workspace
CMD ["rlhfkit", "--help"]
