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
from dsfp4.synthetic.shapes import V4_TINY

F32_NAMES = re.compile(r".*(hc_\w+|attn_sink|\.ape|gate\.bias)")
NORMS = re.compile(r".*norm\.weight")


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> their E8M0 bytes as float8_e8m0fnu."""
    # scale = 0.5 * 2^exp exactly
    exp = torch.frexp(scale)[1] - 1
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
