"""A converted model as another engine's checkpoint (`dsfp4 export`): compressed-tensors, ModelOpt NVFP4, GGUF."""
