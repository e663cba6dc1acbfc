"""DeepSeek-V4: its attention, KV compressor and indexer, mHC residual streams, blocks, the transformer."""
