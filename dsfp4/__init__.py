"""dsfp4: run DeepSeek's big MoE models on one GPU with FP4 experts."""

__version__ = "0.1.0"
