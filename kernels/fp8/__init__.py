"""DeepSeek's FP8 128x128-block weights: dequantization, the decode GEMV (CUDA and tensor cores), the linear."""
