"""DeepSeek-V4-Flash's shape for scripts/bench_model.py (`--family v4`): its config.json and its hash tables.

The writer itself is bench_model.py's, for both families: the backbone tensors come from the family's name
map (convert/names/v4.py for V4) and the experts are MXFP4 records of V4's layout (13,369,344 bytes at full
width). What is V4's alone lives here: the real config.json (v4-flash-spec a.1) cut to the first N layers,
and the token -> experts tables of the hash layers.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

# The official compress_ratios: one entry per main layer (0, 0, then CSA 4 / HCA 128 alternating, the last
# layer CSA), then the MTP block's (sliding) entry; a bench model of N layers takes the first N and the MTP's.
V4_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)
V4_LAYERS = len(V4_RATIOS) - 1  # 43
V4_HASH_LAYERS = 3
# deepseek-ai/DeepSeek-V4-Flash's config.json (v4-flash-spec a.1); num_hidden_layers, compress_ratios,
# num_hash_layers and num_nextn_predict_layers come from the arguments.
V4_DIMS: dict = dict(
    architectures=["DeepseekV4ForCausalLM"],
    model_type="deepseek_v4",
    vocab_size=129280,
    hidden_size=4096,
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_groups=8,
    o_lora_rank=1024,
    sliding_window=128,
    compress_rope_theta=160000,
    rope_theta=10000,
    rope_scaling={
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    max_position_embeddings=1048576,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    n_routed_experts=256,
    num_experts_per_tok=6,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    scoring_func="sqrtsoftplus",
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
    topk_method="noaux_tc",
    swiglu_limit=10.0,
    rms_norm_eps=1e-6,
    expert_dtype="fp4",
    quantization_config={
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    transformers_version="4.57.1",
    attention_bias=False,
    attention_dropout=0.0,
    hidden_act="silu",
    initializer_range=0.02,
    use_cache=True,
)
TABLE_ROWS = 8192  # tokens of a tid2eid table drawn at once (a [rows, n_experts] fp32 draw)


def v4_config(n_layers: int, dims: dict | None = None, mtp: bool = False) -> dict:
    """V4-Flash's config.json for its first `n_layers` layers (and the MTP block with `mtp`); `dims`: keys
    overriding the real model's (applied last, so a test may give its own compress_ratios)."""
    if not 1 <= n_layers <= V4_LAYERS:
        raise ValueError(f"--layers {n_layers}: DeepSeek-V4-Flash has 1 to {V4_LAYERS} layers")
    schedule = {
        "num_hidden_layers": n_layers,
        "num_hash_layers": min(V4_HASH_LAYERS, n_layers),
        # the real list holds n_layers + 1 entries, the MTP block's last; the MTP entry stays even without
        # the block (readers truncate to the blocks present)
        "compress_ratios": [*V4_RATIOS[:n_layers], V4_RATIOS[-1]],
        "num_nextn_predict_layers": int(mtp),
    }
    return {**V4_DIMS, **schedule, **(dims or {})}


def tid2eid_rows(shape: tuple[int, ...], n_experts: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """A hash layer's table [vocab, k] (int64, as the release stores it) in slabs of rows, as the bytes of each
    row: every token gets k distinct experts drawn uniformly (the k smallest of n_experts random keys)."""
    vocab, k = shape
    for r0 in range(0, vocab, TABLE_ROWS):
        keys = rng.random((min(TABLE_ROWS, vocab - r0), n_experts), dtype=np.float32)  # [rows, E]
        ids = np.argpartition(keys, k - 1, axis=1)[:, :k].astype(np.int64)  # [rows, k]
        yield ids.view(np.uint8)
