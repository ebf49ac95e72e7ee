# megatron-async on NVIDIA's PyTorch container, with Megatron-LM at the pinned commit,
# patched, so that an unmodified
#     python /workspace/megatron-lm/pretrain_gpt.py ... --pipeline-schedule 2bw
# runs the plugin. Build:  docker build -t megatron-async .   (docs/cluster.md)
#
# Base: the NVIDIA PyTorch container Megatron-LM's own CI uses at the pinned commit
# (docker/.ngc_version.dev at f8837c04: 26.06). It brings Python 3.12, a CUDA build
# of torch, Transformer Engine and apex matched to each other; docker/install.sh
# keeps all three and fails the build if pip would replace one.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.06-py3
FROM ${BASE_IMAGE}

# MEGATRON_LM_REPO: any git URL or path the build can reach (a local mirror: docker/image.sh);
# "none" leaves Megatron-LM out, and megatron-core's wheel brings megatron/training.
ARG MEGATRON_LM_REPO=https://github.com/NVIDIA/Megatron-LM.git
ARG MEGATRON_LM_COMMIT=f8837c04ef6cbef6cdefb8de001aad63178aebbf
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /workspace

# Megatron-LM at the pin (core_r0.19.0): pretrain_gpt.py and its builders.
RUN if [ "${MEGATRON_LM_REPO}" != none ]; then \
      git init -q megatron-lm \
      && git -C megatron-lm remote add origin "${MEGATRON_LM_REPO}" \
      && git -C megatron-lm fetch -q --depth 1 origin "${MEGATRON_LM_COMMIT}" \
      && git -C megatron-lm checkout -q FETCH_HEAD; \
    fi

# This project: patch Megatron-LM, install both, keep the container's torch/TE/apex.
COPY . /workspace/megatron-async
RUN if [ -d megatron-lm ]; then /workspace/megatron-async/docker/install.sh --megatron-lm /workspace/megatron-lm; \
    else /workspace/megatron-async/docker/install.sh; fi

ENV CUDA_DEVICE_MAX_CONNECTIONS=1 \
    OMP_NUM_THREADS=8 \
    PYTHONUNBUFFERED=1
WORKDIR /workspace/megatron-lm
