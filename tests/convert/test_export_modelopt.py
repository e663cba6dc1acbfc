"""`dsfp4 export --format modelopt` (convert/export/modelopt.py): every NVFP4 matrix, decoded by ModelOpt's formula
(w = e2m1 x weight_scale x weight_scale_2, written here from the format's definition, not from dsfp4's code), equals
dsfp4's own dequantization exactly; FP8 blocks come out as dsfp4's dequantization rounded once to BF16; the
exclusions name exactly the modules not in NVFP4; MXFP4 experts and an FP8 head are refused in one line."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsfp4.convert.export.writer import INDEX, export
from dsfp4.layout.manifest import Manifest
from tests.fixtures.cli import assert_one_line_error, run_cli
from tests.fixtures.converted import convert_fp8
from tests.fixtures.exported import dsfp4_matrices

FORMAT = "modelopt"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _modelopt_weight(weight: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 dequantization: weight [out, in/2] U8 (element 2k in the low nibble, bit 3 the sign),
    scale [out, in/16] E4M3, scale_2 a scalar -> [out, in] fp32."""
    codes = torch.stack([weight & 0xF, weight >> 4], dim=-1).flatten(-2).long()  # [out, in]
    values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    blocks = scale.float().repeat_interleave(16, dim=-1)
    return values * blocks * scale_2.float()


def _exported(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(out.glob("model-*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module")
def fp4_backbone(checkpoints, tmp_path_factory) -> Path:
    return convert_fp8(checkpoints, tmp_path_factory, "fp4-shared", backbone="fp4:shared,dense")


@pytest.mark.parametrize("which", ["fp8 backbone", "fp4:shared,dense"])
def test_nvfp4_is_exact_and_fp8_blocks_are_bf16_of_dsfp4s_dequantization(converted, fp4_backbone, tmp_path, which):
    model = converted if which == "fp8 backbone" else fp4_backbone
    export(model, tmp_path / "mo", FORMAT, progress=False)
    got, ours = _exported(tmp_path / "mo"), dsfp4_matrices(model, Manifest.read(model))
    fp4_modules = {n.removesuffix(".weight_scale_2") for n in got if n.endswith(".weight_scale_2")}
    assert any(".mlp.experts." in m for m in fp4_modules)
    assert (which != "fp8 backbone") == any(".shared_experts." in m for m in fp4_modules)
    for name, want in ours.items():
        if name in fp4_modules:
            g = got[name + ".weight_scale_2"]
            assert g.shape == () and g.dtype == torch.float32
            w = _modelopt_weight(got[name + ".weight"], got[name + ".weight_scale"], g)
            assert torch.equal(w, want.float()), name
        elif name + ".weight" in got:
            assert torch.equal(got[name + ".weight"], want.to(got[name + ".weight"].dtype)), name
        else:
            assert torch.equal(got[name], want), name  # norms, embeddings: as stored
    assert not any(n.endswith("input_scale") for n in got)  # weight-only: no activation scales to state
    for m in fp4_modules:
        if m.endswith("gate_proj"):  # gate and up share one global scale: engines fuse them
            assert torch.equal(got[m + ".weight_scale_2"], got[m.replace("gate_proj", "up_proj") + ".weight_scale_2"])


def test_the_config_says_weight_only_nvfp4_and_excludes_exactly_the_other_modules(converted, tmp_path):
    export(converted, tmp_path / "mo", FORMAT, progress=False)
    cfg = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    nested = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())
    assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "W4A16_NVFP4" and cfg["group_size"] == 16
    assert nested["quantization"]["quant_algo"] == "W4A16_NVFP4" and nested["producer"]["name"] == "dsfp4"
    assert nested["quantization"]["exclude_modules"] == cfg["exclude_modules"] == cfg["ignore"]
    index = json.loads((tmp_path / "mo" / INDEX).read_text())["weight_map"]
    fp4 = {n.rsplit(".", 1)[0] for n in index if n.endswith(".weight_scale_2")}
    matrices = {n.removesuffix(".weight") for n in index if n.endswith(".weight") and (".mlp." in n or "_attn." in n)}
    dense = {m for m in matrices if not m.endswith("norm")} - fp4  # the BF16 matrices: FP8 blocks, the routers
    excluded = cfg["exclude_modules"]

    def hit(module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in excluded)

    assert fp4 and not any(hit(m) for m in fp4)
    assert dense and all(hit(m) for m in dense), [m for m in dense if not hit(m)]
    assert "lm_head" in excluded and hit("model.layers.3.mlp.gate")


def test_what_modelopt_cannot_hold_is_refused_in_one_line(mxfp4_converted, tmp_path):
    r = run_cli("export", mxfp4_converted, tmp_path / "o", "--format", FORMAT)
    assert_one_line_error(r, "MXFP4 experts: ModelOpt's checkpoint has no MXFP4")
    assert not (tmp_path / "o").exists()
    r = run_cli("export", mxfp4_converted, tmp_path / "o", "--format", FORMAT, "--dry-run")
    assert_one_line_error(r, "has no MXFP4")


def test_a_dry_run_prints_sizes_and_writes_nothing(converted, tmp_path):
    r = run_cli("export", converted, tmp_path / "o", "--format", FORMAT, "--dry-run")
    assert r.exit_code == 0 and "total" in r.output and not (tmp_path / "o").exists()
