"""ModelArgs from config.json: the official V3 values, transformers-5 spellings, V2-Lite, bad configs."""

import pytest

from dsfp4.config import ModelArgs, from_hf_config
from dsfp4.errors import ConfigError

# deepseek-ai/DeepSeek-V3 config.json (checkpoint-spec a.1), the fields that matter here
V3 = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "max_position_embeddings": 163840,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def test_official_v3_config():
    a = from_hf_config(V3)
    assert (a.dim, a.n_layers, a.n_mtp_layers, a.n_blocks, a.qk_head_dim) == (7168, 61, 1, 62, 192)
    assert a.has_gate_bias and a.rope_type == "yarn" and a.rope_factor == 40 and a.original_seq_len == 4096
    assert [a.is_moe_layer(i) for i in (0, 2, 3, 60, 61)] == [False, False, True, True, True]
    assert a.eos_token_ids == (1,)


def test_round_trip_through_a_dict_and_strictness():
    a = from_hf_config(V3)
    assert ModelArgs.from_dict(a.to_dict()) == a
    with pytest.raises(ConfigError, match="unknown.*'extra'"):
        ModelArgs.from_dict({**a.to_dict(), "extra": 1})


def test_transformers5_spelling_and_v2_lite_defaults():
    v2 = {
        **V3,
        "model_type": "deepseek_v2",
        "scoring_func": None,
        "topk_method": "greedy",
        "q_lora_rank": None,
        "n_group": None,
        "topk_group": None,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
    }
    a = from_hf_config(v2)
    assert a.score_func == "softmax" and a.q_lora_rank == 0 and not a.has_gate_bias
    assert (a.n_expert_groups, a.rope_type, a.rope_theta) == (1, "default", 5000.0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"topk_group": 9}, "topk_group \\(9\\) exceeds n_group \\(8\\)"),
        ({"n_group": 7}, "not a multiple of n_group"),
        ({"num_experts_per_tok": 200}, "num_experts_per_tok \\(200\\) exceeds"),
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"hidden_size": None}, "'hidden_size' is missing"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2}}, "rope type 'dynamic'"),
    ],
)
def test_bad_configs_name_the_field(edit, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_config({**V3, **edit}, "x/config.json")
