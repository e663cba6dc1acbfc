"""The OpenAI-compatible server (`dsfp4 run MODEL --serve`) and its pieces."""
