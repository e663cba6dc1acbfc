"""kernels/: each Triton kernel against its torch reference."""
