"""Tiny DeepSeek-V4 checkpoints from transformers' DeepseekV4ForCausalLM, and transformers holding a converted
model's weights: the numerical reference for the V4 runtime.

The name table is written out by hand from v4-flash-spec b.2, apart from convert/v4_names.py, so that a slip
there cannot hide here. transformers has no MTP block and zeros for tid2eid: those come seeded at random.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from dsfp4.hf_checkpoint_v4 import V4_TINY, random_v4_values, write_v4_checkpoint
from dsfp4.layout.formats import FORMATS
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.quant import dequantize

TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
BLOCK = {
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
EXPERT = re.compile(r"layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight")


def hf_config(cfg: dict):
    from transformers import DeepseekV4Config

    # transformers edits the dicts it is given (rope_scaling): keep the caller's intact
    keys = copy.deepcopy(
        {k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config", "torch_dtype")}
    )
    return DeepseekV4Config(**keys)


def transformers_name(name: str) -> str | None:
    """Official (and dsfp4) name -> transformers' name; None for the MTP block's, which transformers lacks."""
    if name in TOP:
        return TOP[name]
    if name.startswith("mtp."):
        return None
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{BLOCK[rest]}"


def build_v4_checkpoint(out: Path, cfg: dict | None = None, seed: int = 0) -> Path:
    """transformers' random V4 model at tiny dims, written in the official layout (experts FP4, backbone FP8)."""
    from transformers import DeepseekV4ForCausalLM

    cfg = cfg or V4_TINY
    torch.manual_seed(seed)
    state = DeepseekV4ForCausalLM(hf_config(cfg)).state_dict()
    random = random_v4_values(cfg, seed)
    i = cfg["moe_intermediate_size"]

    def value(name: str) -> torch.Tensor:
        if m := EXPERT.fullmatch(name):
            layer, e, w = m.group(1), int(m.group(2)), m.group(3)
            p = f"model.layers.{layer}.mlp.experts."
            if w == "w2":
                return state[p + "down_proj"][e].float()
            return state[p + "gate_up_proj"][e][:i] if w == "w1" else state[p + "gate_up_proj"][e][i:]
        hf = transformers_name(name)
        if hf is None or name.endswith(("tid2eid", "norm.weight", "_scale", "_base", "gate.bias", "attn_sink", "ape")):
            return random(name)  # MTP, zero/one-initialized parameters: seeded values that show a slip
        return state[hf].float()

    return write_v4_checkpoint(out, cfg, value)


def dequantized_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight of a converted V4 model in float32 (tid2eid as integers) under transformers' names,
    experts fused as transformers holds them; the MTP block left out."""
    model_dir = Path(model_dir)
    m = Manifest.read(model_dir)
    a, out = m.args, {}
    for ref, t in m.tensors.items():
        if ref.startswith(a.mtp_prefixes):
            continue
        with safe_open(model_dir / t.file, "pt") as f:
            parts = [f.get_tensor(t.tensors[c]) for c, _ in FORMATS[t.format].components]
        rest = ref.split(".", 2)[-1]
        hf = transformers_name(ref if ref in TOP or rest in BLOCK else ref + ".weight")  # matrices: module paths
        dtype = torch.int64 if t.format == "i64" else torch.float32
        out[hf] = dequantize(t.format, parts, ref, dtype=dtype)
    for layer in range(a.n_layers):
        ef, data = m.experts[layer], (model_dir / m.experts[layer].file).read_bytes()
        w = [m.record.dequantize(data[o : o + m.record.nbytes]) for o in ef.offsets]
        p = f"model.layers.{layer}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([w1, w3]) for w1, w3, _ in w])
        out[p + "down_proj"] = torch.stack([w2 for _, _, w2 in w])
    return out


def hf_model(model_dir: Path):
    """transformers' DeepseekV4ForCausalLM in float32 holding the converted model's weights."""
    from transformers import DeepseekV4ForCausalLM

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    model = DeepseekV4ForCausalLM(hf_config(cfg)).float().eval()
    model.load_state_dict(dequantized_weights(model_dir), strict=True)
    return model
