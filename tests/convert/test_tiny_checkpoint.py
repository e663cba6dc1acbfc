"""The tiny-checkpoint builder reproduces the official release layout, deterministically, and transformers
loads what it writes (so it can serve as the numerical reference)."""

from __future__ import annotations

import json
import re

import torch
from safetensors import safe_open

from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from dsfp4.layout.manifest import Manifest
from dsfp4.synthetic.hf_v3 import FP8_TENSORS
from tests.fixtures.files import tree_bytes
from tests.fixtures.tiny_checkpoint import build_checkpoint


def _headers(ckpt):
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    dtypes = {}
    for shard in set(weight_map.values()):
        with safe_open(ckpt / shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                dtypes[name] = f.get_slice(name).get_dtype()
    return weight_map, dtypes


def test_fp8_variant_has_the_official_layout(checkpoints):
    ckpt = checkpoints["fp8"]
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    weight_map, dtypes = _headers(ckpt)
    assert set(weight_map) == set(dtypes)  # the index covers every tensor, nothing more
    n = cfg["num_hidden_layers"]
    mtp = {k.split(".", 3)[3] for k in weight_map if k.startswith(f"model.layers.{n}.")}
    assert {
        "embed_tokens.weight",
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.experts.0.down_proj.weight_scale_inv",
    } <= mtp
    apart = [k for k in weight_map if k.endswith("_scale_inv") and weight_map[k] != weight_map[k[: -len("_scale_inv")]]]
    assert apart, "at least one scale must live in another shard than its weight"
    for name, dtype in dtypes.items():
        if name.endswith("weight_scale_inv"):
            assert dtype == "F32"
        elif FP8_TENSORS.fullmatch(name):
            assert dtype == "F8_E4M3" and name + "_scale_inv" in weight_map, name
        else:
            assert dtype == ("F32" if name.endswith("e_score_correction_bias") else "BF16"), name
    assert any(re.search(r"kv_a_proj_with_mqa\.weight$", k) for k in weight_map)


def test_builder_is_deterministic(checkpoints, tmp_path):
    again = build_checkpoint(tmp_path / "again", "fp8")
    assert tree_bytes(again) == tree_bytes(checkpoints["fp8"])


def test_transformers_loads_the_bf16_variant_and_the_tokenizer(checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = checkpoints["bf16"]
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    with safe_open(
        ckpt
        / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][
            "model.layers.1.self_attn.q_b_proj.weight"
        ],
        "pt",
    ) as f:
        want = f.get_tensor("model.layers.1.self_attn.q_b_proj.weight")
    assert torch.equal(model.model.layers[1].self_attn.q_b_proj.weight, want)
    logits = model(torch.tensor([[0, 5, 9, 11]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and bool(torch.isfinite(logits).all())
    tok = AutoTokenizer.from_pretrained(ckpt)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>hi<｜Assistant｜>"
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"


def test_single_file_checkpoint_without_index_converts(tmp_path):
    src = build_checkpoint(tmp_path / "src", "bf16", n_shards=1)
    (src / "model.safetensors.index.json").unlink()
    (src / "model-00001-of-000001.safetensors").rename(src / "model.safetensors")
    convert(src, tmp_path / "out", ConvertOptions(), progress=False)
    assert Manifest.read(tmp_path / "out").record.format == "nvfp4"
