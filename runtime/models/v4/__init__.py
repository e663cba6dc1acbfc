"""DeepSeek-V4: attention, KV compressor and indexer, mHC residual streams, blocks, the transformer, MTP."""
