"""A transformers DeepseekV3/V2ForCausalLM state dict in the release's naming (for hf_v3.write_checkpoint), and
back: a release's FP8/BF16 tensors read and dequantized (read_release), experts fused as transformers holds them.

transformers fuses each layer's routed experts ([E, 2I, D] gate_up_proj, [E, D, I] down_proj); the release stores
them one by one. Its MTP block is layer n (num_hidden_layers) of the state, a decoder layer like the others, with
the extras the release stores beside it (embed_tokens and shared_head.head: copies of the main model's;
enorm, hnorm, eh_proj, shared_head.norm: its own).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from dsfp4.layout.quant import dequantize

EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")


def release_shapes(state: dict[str, torch.Tensor], cfg: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor the release stores for this state (MTP extras included)."""
    n, i_moe = cfg["num_hidden_layers"], cfg["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                shapes[f"{base}{e}.gate_proj.weight"] = shapes[f"{base}{e}.up_proj.weight"] = (i_moe, t.shape[2])
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                shapes[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = tuple(t.shape[1:])
        else:
            shapes[name] = tuple(t.shape)
    dim, vocab = cfg["hidden_size"], cfg["vocab_size"]
    for b in range(n, n + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{b}."
        shapes.update(
            {
                p + "embed_tokens.weight": (vocab, dim),
                p + "enorm.weight": (dim,),
                p + "hnorm.weight": (dim,),
                p + "eh_proj.weight": (dim, 2 * dim),
                p + "shared_head.norm.weight": (dim,),
                p + "shared_head.head.weight": (vocab, dim),
            }
        )
    return shapes


def release_values(
    state: dict[str, torch.Tensor], cfg: dict, fill: Callable[[str], torch.Tensor] | None = None
) -> Callable[[str], torch.Tensor]:
    """value(name) -> the fp32 tensor of a release name: experts unfused, the MTP block's embedding and head copied
    from the main model's; `fill(name)` gives what `state` lacks (and, when given, the norms and the router bias,
    which an untrained transformers model holds at exactly 1 and 0)."""
    i_moe = cfg["moe_intermediate_size"]
    untrained = re.compile(r".*((layernorm|norm)\.weight|e_score_correction_bias)")

    def value(name: str) -> torch.Tensor:
        if m := EXPERT.fullmatch(name):
            e = int(m.group(2))
            if m.group(3) == "down":
                return state[m.group(1) + "down_proj"][e].detach().float().clone()
            fused = state[m.group(1) + "gate_up_proj"][e]
            return (fused[:i_moe] if m.group(3) == "gate" else fused[i_moe:]).detach().float().clone()
        if name in state and not (fill is not None and untrained.fullmatch(name)):
            return state[name].detach().float().clone()
        if name.endswith("embed_tokens.weight") and name.startswith("model.layers."):
            return state["model.embed_tokens.weight"].detach().float().clone()
        if name.endswith("shared_head.head.weight") and "lm_head.weight" in state:
            return state["lm_head.weight"].detach().float().clone()
        if fill is None:
            raise KeyError(f"{name}: not in the state dict")
        return fill(name)

    return value


def read_release(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an FP8 (or BF16) release folder as float32 under its own name, each FP8 weight dequantized
    with its weight_scale_inv (the scales themselves left out)."""
    folder = Path(folder)
    shard_of = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, shard in shard_of.items():
        if name.endswith("weight_scale_inv"):
            continue
        with safe_open(folder / shard, "pt") as f:
            t = f.get_tensor(name)
        if (scale := name[: -len("weight")] + "weight_scale_inv") in shard_of:
            with safe_open(folder / shard_of[scale], "pt") as f:
                t = dequantize("fp8_e4m3_b128", [t, f.get_tensor(scale)], name)
        out[name] = t.float()
    return out


def transformers_keys(cfg: dict) -> dict:
    """A release's config.json as transformers' DeepseekV3/V2Config takes it: without the quantization, the
    architecture list and the storage dtype (the models built from it hold dequantized weights)."""
    return {k: v for k, v in cfg.items() if k not in ("quantization_config", "architectures", "torch_dtype")}


def transformers_state(weights: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Release-named weights -> the state dict of transformers' model: the MTP layers (num_hidden_layers on, which
    transformers has no module for) left out, each MoE layer's experts fused."""
    n, dense = cfg["num_hidden_layers"], cfg.get("first_k_dense_replace", 0)
    state = {k: v for k, v in weights.items() if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)}
    for layer in range(dense, n):
        fuse_experts(state, f"model.layers.{layer}.mlp.experts.", cfg["n_routed_experts"])
    return state


def fuse_experts(state: dict[str, torch.Tensor], prefix: str, n: int) -> None:
    """Per-expert checkpoint tensors -> transformers' fused gate_up_proj [E, 2I, D] and down_proj [E, D, I]."""
    gate_up = [
        torch.cat([state.pop(f"{prefix}{e}.gate_proj.weight"), state.pop(f"{prefix}{e}.up_proj.weight")])
        for e in range(n)
    ]
    state[prefix + "gate_up_proj"] = torch.stack(gate_up)
    state[prefix + "down_proj"] = torch.stack([state.pop(f"{prefix}{e}.down_proj.weight") for e in range(n)])
