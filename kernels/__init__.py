"""Triton kernels, each beside its wrapper and a torch reference (docs/kernels.md)."""
