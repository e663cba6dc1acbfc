"""MLA attention at decode: the cache writes, the absorbed products with wkv_b, flash-decoding."""
