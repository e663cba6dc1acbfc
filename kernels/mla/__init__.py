"""MLA attention: the latent cache writes (prefill and decode), the absorbed wkv_b products and flash-decoding."""
