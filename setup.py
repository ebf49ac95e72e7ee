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
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.19.2",
        "emerging-optimizers==0.3.0",
        "sentencepiece==0.2.3",
        "numpy==2.5.5",
        "matplotlib==3.11.2",
        "psutil==7.2.2",  # Megatron dist_checkpointing writers
        "tensorboard==2.21.0",  # Megatron's --tensorboard-dir
    ],
    extras_require={
        "test": [
            "pytest==9.2.0",
            "hypothesis==6.170.15",
            "pytest-timeout==2.4.0",
        ],
    },
    entry_points={
        "console_scripts": [
            "megatron-async-pretrain=megatron_async.launch:main_gpt",
            "megatron-async-prepare-data=megatron_async.data.prepare:main",
            "megatron-async-simulate=megatron_async.schedules.simulate_cli:main",
        ],
    },
)
