"""Generation: the decoding core, plain and speculative decoding, CUDA graphs, sampling, text in and out, stats."""
