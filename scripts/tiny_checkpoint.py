"""Tiny DeepSeek checkpoints for the tests, in the exact layout of the official releases.

The weights and their names come from transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM at
small dims (independent of dsfp4's own name map, which the tests check against them); dsfp4.hf_checkpoint
writes them the way deepseek-ai/DeepSeek-V3 ships them. Variants: "fp8" (official), "bf16", "nvfp4"
(NVIDIA ModelOpt). `synthetic=True` writes seeded random weights under dsfp4's names instead, for
checkpoints of gigabytes (benchmarks, memory tests).

    python scripts/tiny_checkpoint.py OUT [--variant fp8|bf16|nvfp4] [--dims hidden_size=1024 ...]
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

import torch

from dsfp4.hf_checkpoint import (
    NORMS,
    build_synthetic_checkpoint,
    hf_config_dict,
    nvfp4_extras,
    random_values,
    write_checkpoint,
)


def _transformers_model(cfg: dict, device: str):
    """DeepseekV3ForCausalLM (or V2) with the MTP block(s) built as extra trailing decoder layers."""
    import transformers

    family = {"deepseek_v3": "DeepseekV3", "deepseek_v2": "DeepseekV2"}[cfg["model_type"]]
    keys = {k: v for k, v in cfg.items() if k not in ("quantization_config", "architectures", "torch_dtype")}
    keys["num_hidden_layers"] = cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    config = getattr(transformers, family + "Config")(**keys)
    with torch.device(device):
        return getattr(transformers, family + "ForCausalLM")(config)


def source_tensors(cfg: dict, seed: int, variant: str = "fp8") -> tuple[dict[str, tuple[int, ...]], Callable]:
    """(name -> shape in the release's naming, value(name) -> fp32 tensor) from transformers' model."""
    torch.manual_seed(seed)
    state = _transformers_model(cfg, "cpu").state_dict()
    n, i_moe = cfg["num_hidden_layers"], cfg["moe_intermediate_size"]
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers fuses experts; the release does not
            base = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                shapes[f"{base}{e}.gate_proj.weight"] = shapes[f"{base}{e}.up_proj.weight"] = (i_moe, t.shape[2])
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                shapes[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = tuple(t.shape[1:])
        else:
            shapes[name] = tuple(t.shape)
    if variant == "nvfp4":
        shapes.update(nvfp4_extras(cfg))
    dim, vocab = cfg["hidden_size"], cfg["vocab_size"]
    for b in range(n, n + cfg["num_nextn_predict_layers"]):  # transformers has no MTP extras: add them
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
    random = random_values(shapes, seed)

    def value(name: str) -> torch.Tensor:
        if m := re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name):
            e = int(m.group(2))
            if m.group(3) == "down":
                return state[m.group(1) + "down_proj"][e].detach().clone()
            fused = state[m.group(1) + "gate_up_proj"][e]
            return (fused[:i_moe] if m.group(3) == "gate" else fused[i_moe:]).detach().clone()
        if name in state and not (NORMS.fullmatch(name) or name.endswith("e_score_correction_bias")):
            return state[name].detach().float().clone()
        if name.endswith("embed_tokens.weight") and name.startswith("model.layers."):  # MTP shares them
            return state["model.embed_tokens.weight"].detach().clone()
        if name.endswith("shared_head.head.weight"):
            return state["lm_head.weight"].detach().clone()
        return random(name)  # norms (near 1), the router bias, KV-cache scales, MTP norms and eh_proj

    return shapes, value


def build_checkpoint(
    out: Path, variant: str = "fp8", dims: dict | None = None, seed: int = 0, n_shards: int = 3, synthetic: bool = False
) -> Path:
    """Write a checkpoint folder at `out` (created) and return it; synthetic: random weights, names from
    dsfp4's name map (no transformers init, for checkpoints of gigabytes)."""
    if synthetic:
        return build_synthetic_checkpoint(out, dims, variant, seed, n_shards)
    cfg = hf_config_dict(dims or {}, variant)
    shapes, value = source_tensors(cfg, seed, variant)
    return write_checkpoint(out, cfg, shapes, value, variant, n_shards)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--variant", choices=("fp8", "bf16", "nvfp4"), default="fp8")
    ap.add_argument("--dims", nargs="*", default=[], help="config overrides, e.g. hidden_size=1024")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--synthetic", action="store_true", help="seeded random values, no transformers init")
    a = ap.parse_args()
    dims = {k: json.loads(v) for k, v in (d.split("=", 1) for d in a.dims)}
    print(build_checkpoint(a.out, a.variant, dims, a.seed, a.shards, a.synthetic))


if __name__ == "__main__":
    main()
