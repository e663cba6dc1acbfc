"""transformers' DeepseekV3/V2ForCausalLM loaded with the weights of a converted dsfp4 model, dequantized
to float32 (FP8 backbone and FP4 expert records alike): the numerical reference for the runtime."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from dsfp4.layout.formats import FORMATS
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.quant import dequantize

# dsfp4 name (after "layers.N.") -> transformers module or tensor name; written out by hand, apart from
# convert/hf_names.py, so that a slip there cannot hide here.
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wq": "self_attn.q_proj",
    "attn.wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.wkv_b": "self_attn.kv_b_proj",
    "attn.wo": "self_attn.o_proj",
    "ffn.w1": "mlp.gate_proj",
    "ffn.w3": "mlp.up_proj",
    "ffn.w2": "mlp.down_proj",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
    "embed.weight": "embed_tokens.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj": "eh_proj",
    "head_norm.weight": "shared_head.norm.weight",
    "head.weight": "shared_head.head.weight",
}
TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def hf_name(ref: str) -> str:
    """dsfp4 name -> the name of the same weight in a Hugging Face checkpoint."""
    if ref in TOP_NAMES:
        return TOP_NAMES[ref]
    _, block, rest = ref.split(".", 2)
    hf = BLOCK_NAMES[rest]
    return f"model.layers.{block}.{hf}" + ("" if hf.endswith(("weight", "bias")) else ".weight")


def dequantized_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every weight of the converted model as float32 under its Hugging Face name (experts per expert)."""
    model_dir = Path(model_dir)
    m = Manifest.read(model_dir)
    out = {}
    for ref, t in m.tensors.items():
        with safe_open(model_dir / t.file, "pt") as f:
            parts = [f.get_tensor(t.tensors[c]) for c, _ in FORMATS[t.format].components]
        out[hf_name(ref)] = dequantize(t.format, parts, ref, dtype=torch.float32)
    for layer, ef in m.experts.items():
        data = (model_dir / ef.file).read_bytes()
        for e, offset in enumerate(ef.offsets):
            w1, w3, w2 = m.record.dequantize(data[offset : offset + m.record.nbytes])
            p = f"model.layers.{layer}.mlp.experts.{e}."
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"], out[p + "down_proj.weight"] = w1, w3, w2
    return out


def fuse_experts(state: dict[str, torch.Tensor], prefix: str, n: int) -> None:
    """Per-expert checkpoint tensors -> transformers' fused gate_up_proj [E, 2I, D] and down_proj [E, D, I]."""
    gate_up = [
        torch.cat([state.pop(f"{prefix}{e}.gate_proj.weight"), state.pop(f"{prefix}{e}.up_proj.weight")])
        for e in range(n)
    ]
    state[prefix + "gate_up_proj"] = torch.stack(gate_up)
    state[prefix + "down_proj"] = torch.stack([state.pop(f"{prefix}{e}.down_proj.weight") for e in range(n)])


def hf_model(model_dir: Path, weights: dict[str, torch.Tensor] | None = None):
    """The transformers model of this family in float32, holding `weights` (default: the converted ones)."""
    from transformers import AutoConfig, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    m = Manifest.read(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.quantization_config = None
    cls = {"deepseek_v3": DeepseekV3ForCausalLM, "deepseek_v2": DeepseekV2ForCausalLM}[m.args.family]
    model = cls(cfg).float().eval()
    weights = dequantized_weights(model_dir) if weights is None else weights
    state = {k: v for k, v in weights.items() if not k.startswith(f"model.layers.{m.args.n_layers}.")}
    for layer in range(m.args.n_dense_layers, m.args.n_layers):
        fuse_experts(state, f"model.layers.{layer}.mlp.experts.", m.args.n_routed_experts)
    model.load_state_dict(state, strict=True)
    return model
