"""Packaging for the pipeline-aware FLOPs profiler fork of Megatron-DeepSpeed."""
from setuptools import find_packages, setup

setup(
    name="megatron-flops-profiler",
    version="0.1.0",
    description="GPT pre-training on DeepSpeed with a FLOPs profiler that is correct under pipeline parallelism",
    packages=find_packages(include=["megatron", "megatron.*", "patches", "patches.*"]),
    package_data={"megatron.profiler": ["flops-profile.schema.json"]},
    python_requires=">=3.9",
    # apex is optional and never a dependency: the registry's `apex` is an unrelated package.
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.19.0,<0.20",
        "regex",
        "numpy",
    ],
    extras_require={
        "test": ["pytest", "jsonschema", "tokenizers", "tensorboard", "matplotlib", "psutil"],
        "plot": ["matplotlib"],
    },
)
