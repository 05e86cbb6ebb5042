# megatron_lc on an NGC PyTorch image (CUDA, cuDNN, NCCL, PyTorch, TransformerEngine, apex; flash-attn added if
# the image lacks it). Build and run (docs/operations.md):
#   docker build -t megatron_lc:latest .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 -v "$PWD/runs:/opt/megatron_lc/runs" \
#       megatron_lc:latest torchrun --nproc-per-node 8 pretrain_gpt.py --config configs/llama3_8b_1m.yaml
# On SLURM with pyxis: CONTAINER_IMAGE=<registry>/megatron_lc:latest sbatch scripts/slurm/pretrain_llama3_8b_1m.sbatch
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3
FROM ${BASE_IMAGE}

ARG FLASH_ATTN_VERSION=2.7.4.post1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/megatron_lc

# The image's CUDA builds of torch, TransformerEngine, flash-attn and apex must stay: pin what is installed so no
# requirement (torch>=2.5, megatron-core's) can make pip replace them with PyPI builds.
RUN pip freeze | grep -iE '^(torch|transformer[-_]engine.*|flash[-_]attn|apex|numpy|triton)==' \
        > /etc/megatron_lc_pins.txt \
    && cat /etc/megatron_lc_pins.txt

# flash-attn: keep the image's; build the pinned release only if the image has none.
RUN python -c "import flash_attn" 2>/dev/null \
    || (MAX_JOBS=8 pip install --no-build-isolation -c /etc/megatron_lc_pins.txt "flash-attn==${FLASH_ATTN_VERSION}" \
        && pip freeze | grep -iE '^flash[-_]attn==' >> /etc/megatron_lc_pins.txt)

# Dependencies first (a layer that survives source edits), then the source.
COPY setup.py ./
COPY megatron_lc/__init__.py megatron_lc/
RUN pip install -c /etc/megatron_lc_pins.txt -e ".[dev]"
COPY . .

# Fail the build, not the first job, if the GPU stack is incomplete (apex is optional: reported only).
RUN python -c "import torch, transformer_engine, flash_attn, megatron.core, megatron_lc; \
print('torch', torch.__version__, '| TE', transformer_engine.__version__, '| flash-attn', flash_attn.__version__)" \
    && (python -c "import apex" 2>/dev/null && echo "apex: present" || echo "apex: absent (optional)")

CMD ["python", "pretrain_gpt.py", "--help"]
