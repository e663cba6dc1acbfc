"""DeepSeek-V3 (and V2-Lite): MLA attention, blocks, the transformer, the MTP module."""
