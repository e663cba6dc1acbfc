"""Triton kernels, each beside its wrapper and a torch reference (filled in by the kernels issue)."""
