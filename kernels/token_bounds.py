"""Tokens per call that pick a kernel path: up to DECODE_TOKENS the decode kernels, above DECOMPRESS_TOKENS MLA's
decompressed prefill attention. Plain numbers, free of torch: the command line checks --max-batch against them."""

# tokens per call that the decode kernels (GEMVs on CUDA cores) take: decode steps and MTP verify batches; above
# it the prefill paths on tensor cores win. One bound for all of them, so a call never mixes the two
DECODE_TOKENS = 16
# a sequence's tokens per call above which MLA's prefill attention expands the cached latent rows through wkv_b, a
# key block at a time, and attends in the decompressed form (kernels/mla/prefill.py) instead of the absorbed one;
# at least DECODE_TOKENS. Expanding costs a call the same whatever its tokens: from 48 tokens on the decompressed form
# was as fast or faster at every context measured on the H200, at 32 slower from 8k cached rows
# (scripts/bench_prefill_attention.py)
DECOMPRESS_TOKENS = 32
