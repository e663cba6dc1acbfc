"""FP4 (NVFP4, MXFP4) codes decoded in registers, and the FP4 matmul."""
