"""lit_grpo: GRPO training of language models with PyTorch Lightning and Infinite Sampling."""

__version__ = "0.1.0"
