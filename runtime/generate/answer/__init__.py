"""The shape an answer must take besides its sampling: the tools a model may call (their formats, markup, the
calls read back) and the grammars of constrained decoding, compiled against the model's tokenizer."""
