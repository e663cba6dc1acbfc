"""DeepSeek's FP8 128x128-block weights: dequantization, the decode GEMV, the linear layer."""
