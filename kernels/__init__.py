"""Triton kernels by family and C ones for the CPU (cpu/), each beside its torch reference (docs/kernels.md)."""
