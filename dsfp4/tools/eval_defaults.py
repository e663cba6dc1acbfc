"""The sizes `dsfp4 eval` and scripts/reference_logits.py default to (the contract: dsfp4/tools/evaluate.py). Plain
numbers, free of torch and numpy: the command's help shows them."""

# tokens per window, as llama-perplexity's default
DEFAULT_CONTEXT = 512
# log-probabilities kept per position by --save-logits
DEFAULT_TOP_K = 32
