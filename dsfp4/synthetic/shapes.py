"""The shapes the synthetic models take, by name: each a config.json in its release's key set. V3_TINY and
V4_TINY are the tests' and the demo's models (small, ragged where the formats have edges); V3_FULL and V4_FLASH
are the real models' configs, which the benchmarks write at full width (a few layers of them)."""

from __future__ import annotations

# Ragged on purpose: 96 and 192 are not multiples of 128 (partial FP8 blocks), kv_a has 160 rows.
V3_TINY = dict(
    vocab_size=640,
    hidden_size=256,
    intermediate_size=384,
    moe_intermediate_size=96,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    num_nextn_predict_layers=1,
    max_position_embeddings=2048,
    routed_scaling_factor=2.5,
)
V3_TINY_ROPE = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 512,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# generation_config.json of the releases (sampling defaults DeepSeek recommends)
GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), over the tiny shape's release keys; the bench model's
# writer sets num_hidden_layers, first_k_dense_replace and the MTP layer.
V3_FULL: dict = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
    rope_theta=10000,
    # yarn, mscale 1.0
    rope_scaling={**V3_TINY_ROPE, "factor": 40, "original_max_position_embeddings": 4096},
    rms_norm_eps=1e-6,
    routed_scaling_factor=2.5,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    moe_layer_freq=1,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)
CSA_TYPE, HCA_TYPE = "compressed_sparse_attention", "heavily_compressed_attention"
# All three attention kinds at small compress ratios (transformers' layer_types + compress_rates spelling: the
# official compress_ratios only knows 4 and 128), two hash layers, an MTP block; a window shorter than the
# tests' prompts; the SwiGLU limit low enough that N(0, 0.02) weights reach it.
V4_TINY = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 640,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", CSA_TYPE, HCA_TYPE, CSA_TYPE, HCA_TYPE],
    "compress_rates": {CSA_TYPE: 4, HCA_TYPE: 8},
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    # the YaRN factor times its original length
    "max_position_embeddings": 256,
    "index_n_heads": 8,
    "index_head_dim": 16,
    "index_topk": 3,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "num_hash_layers": 2,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "topk_method": "noaux_tc",
    "swiglu_limit": 0.1,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "expert_dtype": "fp4",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}
# The official compress_ratios: one entry per main layer (0, 0, then CSA 4 / HCA 128 alternating, the last
# layer CSA), then the MTP block's (sliding) entry; a bench model of N layers takes the first N and the MTP's.
V4_FLASH_RATIOS = (0, 0) + (4, 128) * 20 + (4, 0)
# 43
V4_FLASH_LAYERS = len(V4_FLASH_RATIOS) - 1
V4_HASH_LAYERS = 3
# deepseek-ai/DeepSeek-V4-Flash's config.json (v4-flash-spec a.1); num_hidden_layers, compress_ratios,
# num_hash_layers and num_nextn_predict_layers come from the arguments.
V4_FLASH: dict = dict(
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


# config.json's quantization_config of each release variant (bf16 has none): DeepSeek's FP8, NVIDIA's ModelOpt NVFP4
QUANTIZATION_CONFIGS = {
    "fp8": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": "FP8"},
}


# the keys in which another release of the MLA family's config.json differs from V3's, by its model_type (dims win)
MLA_RELEASE_KEYS = {
    # V2-Lite: softmax router, no bias, no renormalization, no MTP
    "deepseek_v2": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "norm_topk_prob": False,
        "num_nextn_predict_layers": 0,
    },
}


def v3_config(dims: dict, variant: str) -> dict:
    """config.json in the official release's key set (scoring/topk fields, legacy rope_scaling): the tiny shape, `dims`
    (config.json keys) over it, and the variant's quantization_config."""
    d = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "moe_layer_freq": 1,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": V3_TINY_ROPE,
        "scoring_func": "sigmoid",
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        **V3_TINY,
        **dims,
    }
    d["num_key_value_heads"] = d["num_attention_heads"]
    d.update(MLA_RELEASE_KEYS.get(d["model_type"], {}), **dims)
    if variant in QUANTIZATION_CONFIGS:
        d["quantization_config"] = QUANTIZATION_CONFIGS[variant]
    return d


def v4_flash_config(n_layers: int, dims: dict | None = None, mtp: bool = False) -> dict:
    """V4-Flash's config.json for its first `n_layers` layers (and the MTP block with `mtp`); `dims`: keys
    overriding the real model's (applied last, so a test may give its own compress_ratios)."""
    if not 1 <= n_layers <= V4_FLASH_LAYERS:
        raise ValueError(f"--layers {n_layers}: DeepSeek-V4-Flash has 1 to {V4_FLASH_LAYERS} layers")
    schedule = {
        "num_hidden_layers": n_layers,
        "num_hash_layers": min(V4_HASH_LAYERS, n_layers),
        # the real list holds n_layers + 1 entries, the MTP block's last; the MTP entry stays even without
        # the block (readers truncate to the blocks present)
        "compress_ratios": [*V4_FLASH_RATIOS[:n_layers], V4_FLASH_RATIOS[-1]],
        "num_nextn_predict_layers": int(mtp),
    }
    return {**V4_FLASH, **schedule, **(dims or {})}
