"""The name map: tiny V3 variants map completely; a DeepSeek-V2-Lite-shaped checkpoint (names from
transformers' own DeepseekV2 model, not from our tables) maps too."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dsfp4.convert.names.family import map_tensors
from dsfp4.convert.names.rules import AUX, EXPERT, LINEAR, PLAIN
from dsfp4.convert.source.checkpoint import SourceCheckpoint
from dsfp4.convert.source.hf_config import from_hf_config
from dsfp4.errors import SourceError
from dsfp4.layout.safetensors_file import SAFETENSORS_NAMES, TensorInfo


def _map(src: SourceCheckpoint, **kw):
    return map_tensors(
        src.args,
        {n: t.info for n, t in src.tensors.items()},
        {n: t.shard for n, t in src.tensors.items()},
        "index",
        **kw,
    )


@pytest.mark.parametrize("variant", ["fp8", "bf16", "nvfp4"])
def test_tiny_v3_variants_map_every_tensor(checkpoints, variant):
    with SourceCheckpoint(checkpoints[variant]) as src:
        tmap = _map(src)
        a = src.args
    consumed = [s for i in tmap.items for s in i.sources.values()]
    assert len(consumed) == len(set(consumed))
    kinds = Counter(i.kind for i in tmap.items)
    n_moe = sum(a.is_moe_layer(b) for b in range(a.n_blocks))
    assert kinds[EXPERT] == 3 * a.n_routed_experts * n_moe
    assert kinds[LINEAR] == 8 * a.n_blocks and kinds[AUX] == a.n_mtp_layers
    assert kinds[PLAIN] == 3 + a.n_blocks * 2 + a.n_blocks * 2 + (n_moe * 2) + 5 * a.n_mtp_layers
    storage = Counter(i.storage for i in tmap.items if i.kind == EXPERT)
    want = {"fp8": {"fp8_e4m3_b128"}, "bf16": {"bf16"}, "nvfp4": {"nvfp4", "bf16"}}[variant]
    assert set(storage) == want


def _v2_lite_tensors():
    """Tensor names and shapes of a tiny DeepSeek-V2-Lite (no q_lora, softmax router, no bias, 2 shared)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=384,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        q_lora_rank=None,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
    )
    with torch.device("meta"):
        state = DeepseekV2ForCausalLM(cfg).state_dict()
    infos = {}
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):  # on disk the experts are separate tensors
            for e in range(t.shape[0]):
                for proj in ("gate", "up"):
                    n = f"{name[: -len('gate_up_proj')]}{e}.{proj}_proj.weight"
                    infos[n] = TensorInfo(n, "BF16", (t.shape[1] // 2, t.shape[2]), 0, 0)
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                n = f"{name[: -len('down_proj')]}{e}.down_proj.weight"
                infos[n] = TensorInfo(n, "BF16", tuple(t.shape[1:]), 0, 0)
        else:
            infos[name] = TensorInfo(name, SAFETENSORS_NAMES[torch.bfloat16], tuple(t.shape), 0, 0)
    return cfg.to_dict(), infos


def test_v2_lite_names_map():
    cfg, infos = _v2_lite_tensors()
    args = from_hf_config(cfg)
    tmap = map_tensors(args, infos, dict.fromkeys(infos, "model.safetensors"), "model.safetensors")
    refs = {i.ref for i in tmap.items}
    assert "layers.1.attn.wq" in refs and "layers.1.attn.wq_a" not in refs
    assert "layers.1.ffn.gate.bias" not in refs and "layers.1.ffn.shared_experts.w1" in refs
    assert sum(i.kind == EXPERT for i in tmap.items) == 3 * 8 * 2
    del infos["model.layers.2.mlp.gate.weight"]
    with pytest.raises(SourceError, match="model.layers.2.mlp.gate.weight is missing"):
        map_tensors(args, infos, dict.fromkeys(infos, "model.safetensors"), "model.safetensors")


def test_missing_mtp_layer_suggests_no_mtp(checkpoints):
    with SourceCheckpoint(checkpoints["fp8"]) as src:
        infos = {n: t.info for n, t in src.tensors.items() if not n.startswith(f"model.layers.{src.args.n_layers}.")}
        with pytest.raises(SourceError, match="pass --no-mtp"):
            map_tensors(src.args, infos, {n: "x" for n in infos}, "index")
        assert map_tensors(src.args, infos, {n: "x" for n in infos}, "index", include_mtp=False).items
