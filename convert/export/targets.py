"""The checkpoints `dsfp4 export` writes, by their --format names (writer.py writes each). Free of torch and
safetensors: export's help lists them."""

FORMATS = ("compressed-tensors", "modelopt", "gguf")
