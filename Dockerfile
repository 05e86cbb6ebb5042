# megatron_lc on the PyTorch release it is tested with (torch 2.13.0, as scripts/install.sh pins it) over CUDA and
# cuDNN, with flash-attn and TransformerEngine built against that torch. Build and run (docs/operations.md):
#   docker build -t megatron_lc:latest .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 -v "$PWD/runs:/opt/megatron_lc/runs" \
#       megatron_lc:latest torchrun --nproc-per-node 8 pretrain_gpt.py --config configs/llama3_8b_1m.yaml
# On SLURM with pyxis: CONTAINER_IMAGE=<registry>/megatron_lc:latest sbatch scripts/slurm/pretrain_llama3_8b_1m.sbatch
#
# Why not NGC's PyTorch image: its torch is NVIDIA's build of an older release (pytorch:25.04 -> torch 2.7), and the
# code calls APIs that release lacks (torch.nn.attention.varlen.varlen_attn, FSDP2's
# set_force_sum_reduction_for_comms, DCP's no_dist, ...); torch cannot be swapped in such an image without
# rebuilding its TransformerEngine, apex and flash-attn. So the base is PyTorch's own image of the tested release
# (its torch is the pinned wheel), and tools/preflight.py fails the build if an API the code calls is missing. A new
# torch: change TORCH_VERSION here and in scripts/install.sh together (tests/repo/test_docker.py checks both agree).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG FLASH_ATTN_VERSION=2.7.4.post1
ARG TE_VERSION=2.8.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# (CUDA_DEVICE_MAX_CONNECTIONS is not set here: each rank sets it where tensor-parallel overlap needs it, tp > 1,
# training/process_group.cuda_connections; with tp 1 it would serialise FSDP2's gathers behind long kernels)
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/megatron_lc

# The image's torch must be the tested release (a base tag with another one fails here), and stays: pin what is
# installed so no requirement (torch>=2.5, megatron-core's) can make pip replace it with another build.
RUN python -c "import torch, sys; v = torch.__version__.split('+')[0]; \
sys.exit(0 if v == '${TORCH_VERSION}' else 'base image has torch ' + v + ', expected ${TORCH_VERSION}')" \
    && pip freeze | grep -iE '^(torch|triton|numpy)==' > /etc/megatron_lc_pins.txt \
    && cat /etc/megatron_lc_pins.txt

# flash-attn and TransformerEngine, compiled against this torch (their wheels must match its C++ ABI): built with
# --no-build-isolation, so their build tools come first; on a builder without a GPU the architectures are named
# (torch's cpp_extension would otherwise ask the driver for them) and the driver's stub library stands in for
# libcuda. About 1-2 hours on 8 cores (flash-attn the most of it; MAX_JOBS bounds the memory, ~4 GB a job).
ENV TORCH_CUDA_ARCH_LIST="8.0;9.0" \
    NVTE_CUDA_ARCHS="80;90" \
    FLASH_ATTENTION_FORCE_BUILD=TRUE
RUN pip install -c /etc/megatron_lc_pins.txt wheel packaging ninja pybind11 \
    && export LIBRARY_PATH="/usr/local/cuda/lib64/stubs:${LIBRARY_PATH:-}" \
    && MAX_JOBS=8 pip install --no-build-isolation -c /etc/megatron_lc_pins.txt "flash-attn==${FLASH_ATTN_VERSION}" \
    && NVTE_FRAMEWORK=pytorch pip install --no-build-isolation -c /etc/megatron_lc_pins.txt \
        "transformer_engine[pytorch]==${TE_VERSION}" \
    && pip freeze | grep -iE '^(flash[-_]attn|transformer[-_]engine.*)==' >> /etc/megatron_lc_pins.txt

# Dependencies first (a layer that survives source edits), then the source.
COPY setup.py ./
COPY megatron_lc/__init__.py megatron_lc/
RUN pip install -c /etc/megatron_lc_pins.txt -e ".[dev]"
COPY . .

# Fail the build, not the first job, if the GPU stack is incomplete: every API the code calls, then the imports.
RUN python tools/preflight.py --require flash-attn,te \
    && python -c "import torch, transformer_engine, flash_attn, megatron.core, megatron_lc; \
print('torch', torch.__version__, '| TE', transformer_engine.__version__, '| flash-attn', flash_attn.__version__)"

CMD ["python", "pretrain_gpt.py", "--help"]
