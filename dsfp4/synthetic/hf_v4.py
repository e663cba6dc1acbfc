"""DeepSeek-V4 checkpoints written in the layout of the official release (v4-flash-spec b), at tiny dims.

Names are DeepSeek's (no `model.` prefix, MTP under `mtp.0.`); the matrices DeepSeek ships in FP8 are e4m3
with E8M0 128x128 block scales under `.scale`, routed experts are e2m1 codes packed two per int8 (even
element in the low nibble) with E8M0 1x32 scales, the rest BF16, F32 or I64 as in b.2. Used by
`dsfp4 demo --family v4` (seeded random weights) and by the tests (transformers' weights,
tests/fixtures/v4_checkpoint.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from dsfp4.convert.names.family import source_names
from dsfp4.convert.names.rules import EXPERT, LINEAR
from dsfp4.convert.source.hf_config import from_hf_config
from dsfp4.layout.fp4 import E8M0_BIAS, mxfp4_quantize
from dsfp4.layout.fp8 import fp8_block_quantize
from dsfp4.layout.safetensors_file import SAFETENSORS_NAMES, SafetensorsWriter
from dsfp4.synthetic.hf_v3 import name_generator, shard_files, write_checkpoint_files

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
    "max_position_embeddings": 256,  # the YaRN factor times its original length
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
F32_NAMES = re.compile(r".*(hc_\w+|attn_sink|\.ape|gate\.bias)")
NORMS = re.compile(r".*norm\.weight")


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> their E8M0 bytes as float8_e8m0fnu."""
    exp = torch.frexp(scale)[1] - 1  # scale = 0.5 * 2^exp exactly
    return (exp + E8M0_BIAS).to(torch.uint8).view(torch.float8_e8m0fnu)


def stored_tensors(name: str, w: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """The tensors the release stores for one weight `name` (fp32 values) of rule kind `kind`."""
    base = name.removesuffix(".weight")
    if kind == LINEAR:
        q, scale = fp8_block_quantize(w, name, pow2=True)
        return {name: q, base + ".scale": _e8m0(scale)}
    if kind == EXPERT:
        packed, scale = mxfp4_quantize(w, name)
        return {name: packed.view(torch.int8), base + ".scale": scale.view(torch.float8_e8m0fnu)}
    if name.endswith("tid2eid"):
        return {name: w.to(torch.int64)}
    return {name: w.to(torch.float32 if F32_NAMES.fullmatch(name) else torch.bfloat16)}


def write_v4_checkpoint(out: Path, cfg: dict, value: Callable[[str], torch.Tensor], n_shards: int = 2) -> Path:
    """Write every tensor config.json implies, value(name) giving its fp32 (or integer) values, in the release's
    storage, sharded with an index, plus config.json, generation_config.json and a tokenizer; returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, (shape, kind) in source_names(from_hf_config(cfg)).items():
        w = value(name)
        if tuple(w.shape) != shape:
            raise ValueError(f"{name}: value of shape {list(w.shape)}, config.json implies {list(shape)}")
        tensors.update(stored_tensors(name, w, kind))
    names = list(tensors)
    files = shard_files(n_shards)
    shard_of = {n: files[i * n_shards // len(names)] for i, n in enumerate(names)}
    for f in files:
        mine = [n for n in names if shard_of[n] == f]
        writer = SafetensorsWriter(
            out / f, [(n, SAFETENSORS_NAMES[tensors[n].dtype], tuple(tensors[n].shape)) for n in mine]
        )
        for n in mine:
            writer.write(n, tensors[n])
        writer.close()
    write_checkpoint_files(out, cfg, shard_of, sum(t.nbytes for t in tensors.values()))
    return out


def random_v4_values(cfg: dict, seed: int) -> Callable[[str], torch.Tensor]:
    """Seeded values per name, shaped by the name map: weights N(0, 0.02), norms and mHC scales near 1, a
    token -> distinct experts table for the hash layers, small biases and sinks."""
    shapes = {n: s for n, (s, _) in source_names(from_hf_config(cfg)).items()}

    def value(name: str) -> torch.Tensor:
        g = name_generator(name, seed)
        shape = shapes[name]
        if name.endswith("tid2eid"):
            return torch.stack(
                [torch.randperm(cfg["n_routed_experts"], generator=g)[: shape[1]] for _ in range(shape[0])]
            )
        if NORMS.fullmatch(name) or name.endswith("_scale"):
            return 1.0 + 0.05 * torch.randn(shape, generator=g)
        return 0.02 * torch.randn(shape, generator=g)

    return value


def build_synthetic_v4_checkpoint(out: Path, dims: dict | None = None, seed: int = 0) -> Path:
    """A tiny V4 checkpoint of random weights with the names the converter expects (no transformers needed)."""
    cfg = {**V4_TINY, **(dims or {})}
    return write_v4_checkpoint(out, cfg, random_v4_values(cfg, seed))
