"""FP4 (NVFP4, MXFP4) codes decoded in registers, the FP4 matmul, and cold records widened to FP4 on the device."""
