"""Generation: one sequence or a batch, MTP drafts, CUDA graphs, sampling, prompts and their cache, text, stats."""
