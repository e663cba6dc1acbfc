"""A release folder written again in another of the releases' storages: NVIDIA's ModelOpt NVFP4 export
("nvfp4": MLP projections and o_proj of the main layers in NVFP4, attention and the MTP layer BF16) or all BF16,
from an FP8 (or BF16) release. Weights are dequantized once and quantized again (FP8 -> NVFP4 adds NVFP4's
error); its tokenizer files are copied. For measuring `dsfp4 convert` from an NVFP4 source on a trained model.

    python scripts/release_variant.py SRC OUT --variant nvfp4|bf16
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dsfp4.synthetic.hf_state import read_release
from dsfp4.synthetic.hf_v3 import nvfp4_extras, random_values, write_checkpoint
from dsfp4.synthetic.shapes import QUANTIZATION_CONFIGS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--variant", choices=("nvfp4", "bf16"), required=True)
    a = p.parse_args(argv)
    cfg = json.loads((a.src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if a.variant in QUANTIZATION_CONFIGS:
        cfg["quantization_config"] = QUANTIZATION_CONFIGS[a.variant]
    state = read_release(a.src)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    if a.variant == "nvfp4":
        shapes |= nvfp4_extras(cfg)  # the export's KV-cache scales: stand-ins, MLA does not use them
    stand_in = random_values(shapes, 0)
    write_checkpoint(a.out, cfg, shapes, lambda n: state[n] if n in state else stand_in(n), a.variant, 4, False)
    for name in TOKENIZER_FILES:
        shutil.copyfile(a.src / name, a.out / name)
    print(a.out)


if __name__ == "__main__":
    main()
