"""ModelArgs from config.json: the official V3 values, transformers-5 spellings, V2-Lite, bad configs."""

import dataclasses
import json
import math
import shutil

import pytest

from dsfp4.convert.source.hf_config import from_hf_config
from dsfp4.errors import ConfigError, ManifestError
from dsfp4.layout.manifest import MANIFEST_NAME, Manifest
from dsfp4.layout.model_args import FLOAT_RANGES, ModelArgs
from tests.fixtures.cli import assert_one_line_error, run_cli

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


def _rope(**change):
    return {"rope_scaling": {**V3["rope_scaling"], **change}}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite number, got nan"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number above 0, got -1e-06"),
        ({"rms_norm_eps": 0}, "rms_norm_eps must be a finite number above 0, got 0.0"),
        ({"routed_scaling_factor": math.nan}, "routed_scaling_factor must be a finite number, got nan"),
        ({"rope_theta": math.inf}, "rope_theta must be a finite number, got inf"),
        ({"rope_theta": -5}, "rope_theta must be a finite number above 0"),
        (_rope(factor=-4), "rope_scaling.factor must be a finite number above 0"),
        (_rope(beta_fast=math.nan), "beta_fast must be a finite number, got nan"),
        (_rope(mscale=-1.0), "rope_scaling.mscale must be a finite number at least 0"),
    ],
)
def test_float_fields_are_finite_and_in_their_range(edit, message):
    with pytest.raises(ConfigError, match=message):
        from_hf_config({**V3, **edit}, "x/config.json")


def test_every_float_field_has_a_range():
    floats = {f.name for f in dataclasses.fields(ModelArgs) if f.type == "float"}
    assert floats == set(FLOAT_RANGES)


@pytest.mark.parametrize(("field", "value"), [("norm_eps", math.nan), ("route_scale", -1.0), ("rope_theta", math.inf)])
def test_a_manifest_with_a_float_out_of_range_is_refused_on_open(converted, tmp_path, field, value):
    model = shutil.copytree(converted, tmp_path / "model")
    d = json.loads((model / MANIFEST_NAME).read_text())
    d["model"][field] = value
    (model / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ManifestError, match=f"{FLOAT_RANGES[field][0]} must be a finite number"):
        Manifest.open(model)


# deepseek-ai/DeepSeek-V4-Flash config.json (v4-flash-spec a.1)
V4_FLASH = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "topk_method": "noaux_tc",
    "swiglu_limit": 10.0,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "expert_dtype": "fp4",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}


def test_official_v4_flash_config():
    a = from_hf_config(V4_FLASH)
    assert a.family == "deepseek_v4"
    assert (a.n_layers, a.n_blocks, a.head_dim, a.qk_rope_head_dim, a.qk_nope_head_dim) == (
        43,
        44,
        512,
        64,
        448,
    )
    # compress_ratios has n_layers + 1 entries: layer 42 is CSA, the MTP block (43) sliding
    assert a.layer_kinds.count("sliding") == 3 and a.layer_kinds.count("csa") == 21 and a.layer_kinds.count("hca") == 20
    assert (a.layer_kinds[42], a.layer_kinds[43], a.compress_ratios[2], a.compress_ratios[3]) == (
        "csa",
        "sliding",
        4,
        128,
    )
    assert (a.rope_theta, a.compress_rope_theta, a.rope_type, a.rope_factor, a.original_seq_len) == (
        10000,
        160000,
        "yarn",
        16,
        65536,
    )
    assert [a.is_hash_layer(i) for i in (0, 2, 3)] == [True, True, False]
    assert [a.layer_has_gate_bias(i) for i in (2, 3, 43)] == [False, True, True]
    assert (a.swiglu_limit, a.route_scale, a.score_func, a.n_dense_layers) == (10.0, 1.5, "sqrtsoftplus", 0)
    assert ModelArgs.from_dict(a.to_dict()) == a


def test_v4_transformers_spelling_matches_the_official_one():
    types = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    hf = {k: v for k, v in V4_FLASH.items() if k not in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim")}
    hf.update(
        layer_types=[types[r] for r in V4_FLASH["compress_ratios"][:43]],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40,
        partial_rotary_factor=0.125,
        rope_scaling=None,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 10000.0},
            "compress": {**V4_FLASH["rope_scaling"], "rope_theta": 160000.0},
        },
    )
    assert from_hf_config(hf) == from_hf_config(V4_FLASH)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"compress_ratios": [0] * 43}, "compress_ratios must hold 44 entries"),
        ({"compress_ratios": [0, 0, 8] + [0] * 41}, "compress_ratios must hold 44"),
        ({"num_key_value_heads": 8}, "one shared K=V head"),
        ({"o_groups": 5}, "not a multiple of o_groups"),
        ({"hc_mult": None}, "required field 'hc_mult'"),
        ({"hc_eps": 0}, "hc_eps must be above 0"),
        ({"compress_rope_theta": math.inf}, "compress_rope_theta must be a finite number"),
        ({"compress_rope_theta": 0}, "compress_rope_theta must be above 0"),
        ({"swiglu_limit": -1}, "swiglu_limit must be a finite number at least 0"),
    ],
)
def test_bad_v4_configs(change, needle):
    with pytest.raises(ConfigError, match=needle):
        from_hf_config({**V4_FLASH, **change})


def test_a_v3_manifest_written_before_the_v4_fields_still_loads():
    a = from_hf_config(V3)
    old = {k: v for k, v in a.to_dict().items() if k not in ("head_dim", "layer_kinds", "swiglu_limit", "hc_mult")}
    assert ModelArgs.from_dict(old) == a


def test_convert_refuses_a_nan_float_in_one_line(checkpoints, tmp_path):
    src = shutil.copytree(checkpoints["fp8"], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": math.nan}))
    result = run_cli("convert", "--fp4", src, tmp_path / "out", "-q")
    assert_one_line_error(result, "config.json", "rms_norm_eps must be a finite number, got nan")
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
