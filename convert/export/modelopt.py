"""A converted model as a ModelOpt NVFP4 checkpoint (`dsfp4 export --format modelopt`): NVIDIA's layout, which
TensorRT-LLM, vLLM and SGLang load. Weight-only NVFP4 (ModelOpt's W4A16_NVFP4), the arithmetic dsfp4 itself does:

  NVFP4               `weight` (U8, element 2k in the low nibble), `weight_scale` (E4M3 [out, in / 16], linear),
                      `weight_scale_2` (F32 scalar, the per-tensor multiplier: w = e2m1 x weight_scale x
                      weight_scale_2), the stored bytes as they are
  FP8 128x128 blocks  `weight` in BF16, dequantized (one rounding), and listed in the exclusions: ModelOpt's mixed
                      precision takes per-tensor FP8 only, so block-scaled FP8 cannot sit beside NVFP4 (NVIDIA's own
                      DeepSeek-R1-FP4 keeps attention in BF16 too)
  plain (BF16, F32)   `weight` as stored; lm_head and the routers are excluded

Limits, stated: no `input_scale` (ModelOpt's W4A4 NVFP4 quantizes activations with scales calibrated on data, which
dsfp4 does not compute: an engine runs these weights with 16-bit activations, on Hopper through its Marlin kernels);
MXFP4 experts cannot be expressed (refused, naming the formats that hold them). A routed expert's gate and up share
one weight_scale_2 (engines fuse them): a record whose two differ is refused.

The exclusions are fnmatch patterns of module names, layer and expert numbers as `*`. config.json's
quantization_config (flat, quant_method "modelopt") replaces DeepSeek's FP8 one; hf_quant_config.json (ModelOpt's
nested form) says the same for the tools that read that file.
"""

from __future__ import annotations

import re

import torch

from dsfp4.convert.backbone import FP8
from dsfp4.convert.export.compressed_tensors import Module, OutTensor, Read, kind_formats
from dsfp4.errors import FormatError
from dsfp4.layout.quant import PLAIN_DTYPES, dequantize
from dsfp4.version import __version__

QUANT_ALGO = "W4A16_NVFP4"
GROUP_SIZE = 16
HF_QUANT_CONFIG = "hf_quant_config.json"
ALWAYS_EXCLUDED = ("lm_head", "model.layers.*.mlp.gate")


def matrix(module: str, fmt: str, parts: dict[str, Read], shapes: dict[str, tuple[int, ...]]) -> list[OutTensor]:
    """A stored matrix's tensors under ModelOpt's names (parts: component -> reader; shapes: component -> shape, and
    "dtype": the stored weight's)."""
    if fmt == "nvfp4":
        g = parts["scale_2"]
        return [
            OutTensor(f"{module}.weight", "U8", shapes["weight"], parts["weight"]),
            OutTensor(f"{module}.weight_scale", "F8_E4M3", shapes["scale"], parts["scale"]),
            OutTensor(f"{module}.weight_scale_2", "F32", (), lambda g=g: g().float().reshape(())),
        ]
    if fmt == FP8:
        out_shape = (shapes["weight"][0], shapes["weight"][1])

        def bf16(w=parts["weight"], s=parts["scale"], name=module) -> torch.Tensor:
            return dequantize(FP8, (w(), s()), name, dtype=torch.bfloat16)

        return [OutTensor(f"{module}.weight", "BF16", out_shape, bf16)]
    if fmt in PLAIN_DTYPES:
        return [OutTensor(f"{module}.weight", shapes["dtype"], shapes["weight"], parts["weight"])]
    raise FormatError(
        f"{module}: stored as {fmt}, which ModelOpt's NVFP4 checkpoint cannot express; export --format "
        "compressed-tensors or gguf"
    )


def _pattern(name: str) -> str:
    """A module name with its numbers as `*`: the fnmatch pattern of its kind."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def exclusions(modules: list[Module]) -> list[str]:
    """The fnmatch patterns of every module not in NVFP4 (lm_head and the routers always); FormatError when a kind is
    stored in two formats (one pattern could not say which)."""
    kinds = kind_formats(modules, _pattern)
    return [*ALWAYS_EXCLUDED, *sorted(k for k, fmt in kinds.items() if fmt != "nvfp4")]


def quantization_config(modules: list[Module]) -> tuple[dict, dict]:
    """(config.json's quantization_config, hf_quant_config.json) for these modules; FormatError for MXFP4 experts."""
    if any(m.format == "mxfp4" for m in modules):
        raise FormatError(
            "MXFP4 experts: ModelOpt's checkpoint has no MXFP4; export --format compressed-tensors or gguf, or convert "
            "again with --format nvfp4"
        )
    excluded = exclusions(modules)
    producer = {"name": "dsfp4", "version": __version__}
    flat = {
        "quant_method": "modelopt",
        "quant_algo": QUANT_ALGO,
        "group_size": GROUP_SIZE,
        "kv_cache_quant_algo": None,
        "exclude_modules": excluded,
        "ignore": excluded,
        "producer": producer,
    }
    nested = {
        "producer": producer,
        "quantization": {
            "quant_algo": QUANT_ALGO,
            "kv_cache_quant_algo": None,
            "group_size": GROUP_SIZE,
            "exclude_modules": excluded,
        },
    }
    return flat, nested
