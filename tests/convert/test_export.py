"""`dsfp4 export --format compressed-tensors` (convert/export/): every tensor, decompressed by the compressed-tensors
package's own decompressors, equals dsfp4's dequantization of the stored bytes (exactly for FP8 blocks and MXFP4;
NVFP4 within the library's bf16 output, which it matches where bf16 holds the values); each module matches one
config group or the ignore list; the export streams, resumes and refuses bad input with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dsfp4.convert.export.compressed_tensors import _global
from dsfp4.convert.export.writer import INDEX, export
from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from dsfp4.errors import FormatError
from dsfp4.layout.manifest import Manifest
from tests.fixtures.cli import assert_one_line_error, run_cli
from tests.fixtures.exported import dsfp4_matrices

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from compressed_tensors.utils.match import match_name  # noqa: E402

FORMAT = "compressed-tensors"


def _theirs(out: Path) -> tuple[dict[str, torch.Tensor], QuantizationConfig, dict]:
    """The exported modules decompressed by compressed-tensors (plain tensors as they are)."""
    cfg = json.loads((out / "config.json").read_text())
    qc = QuantizationConfig.model_validate(cfg["quantization_config"])
    tensors = {}
    for f in sorted(out.glob("model-*.safetensors")):
        tensors.update(load_file(f))
    modules: dict[str, dict[str, torch.Tensor]] = {}
    plain = {}
    for name, t in tensors.items():
        module, suffix = name.rsplit(".", 1)
        if suffix in ("weight_packed", "weight_scale", "weight_global_scale") or (
            suffix == "weight" and any(match_name(module, x) for g in qc.config_groups.values() for x in g.targets)
        ):
            modules.setdefault(module, {})[suffix] = t
        else:
            plain[name] = t
    out_tensors = dict(plain)
    for module, sd in modules.items():
        (group,) = [g for g in qc.config_groups.values() if any(match_name(module, x) for x in g.targets)]
        out_tensors[module] = BaseCompressor.get_value_from_registry(group.format).decompress(sd, group)["weight"]
    return out_tensors, qc, cfg


@pytest.mark.parametrize("which", ["nvfp4", "mxfp4"])
def test_every_tensor_decompresses_to_dsfp4s_own_dequantization(converted, mxfp4_converted, tmp_path, which):
    model = converted if which == "nvfp4" else mxfp4_converted
    m = Manifest.read(model)
    export(model, tmp_path / "ct", FORMAT, progress=False)
    theirs, qc, cfg = _theirs(tmp_path / "ct")
    ours = dsfp4_matrices(model, m)
    for name, want in ours.items():
        got = theirs[name] if name in theirs else theirs[name + ".weight"]  # a plain matrix keeps `.weight`
        if "experts." in name and ".shared_experts." not in name and which == "nvfp4":
            # the library computes in bf16 (block scale / global scale, then times the element): two roundings
            torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=0, msg=name)
        else:
            assert torch.equal(got.float(), want.float()), name
    assert len(theirs) == len(ours)
    assert cfg["quantization_config"]["format"] == "mixed-precision" and cfg["model_type"]
    formats = sorted(g.format for g in qc.config_groups.values())
    assert formats == sorted(["float-quantized", f"{which}-pack-quantized"])


def test_each_quantized_module_matches_one_group_and_no_plain_one_matches_any(converted, tmp_path):
    export(converted, tmp_path / "ct", FORMAT, progress=False)
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    index = json.loads((tmp_path / "ct" / INDEX).read_text())["weight_map"]
    quantized = {n.rsplit(".", 1)[0] for n in index if n.endswith(".weight_scale")}
    plain = {n.rsplit(".", 1)[0] for n in index if n.endswith(".weight")} - quantized
    assert quantized and plain
    for module in quantized | plain:
        groups = [k for k, g in cfg["config_groups"].items() if any(match_name(module, t) for t in g["targets"])]
        assert len(groups) == (module in quantized), module
        if ".experts." in module:
            assert groups == ["group_1"], module  # the FP8 group never takes a routed expert
    ignored = [m for m in plain if any(match_name(m, t) for t in cfg["ignore"])]
    assert any(m.endswith(".eh_proj") for m in ignored)  # a plain matrix is listed as such
    assert "lm_head" in cfg["ignore"]


def test_an_interrupted_export_resumes_and_a_dry_run_writes_nothing(converted, tmp_path):
    out = tmp_path / "ct"
    r = run_cli("export", converted, out, "--format", FORMAT, "--dry-run")
    assert r.exit_code == 0 and "total" in r.output and not out.exists()
    shards = export(converted, out, FORMAT, progress=False)
    first = {p.name: p.stat().st_mtime_ns for p in out.glob("model-*.safetensors")}
    (out / INDEX).unlink()
    (out / shards[-1].name).unlink()
    export(converted, out, FORMAT, progress=False)
    again = {p.name: p.stat().st_mtime_ns for p in out.glob("model-*.safetensors")}
    assert (out / INDEX).is_file() and set(again) == set(first)
    assert all(again[n] == first[n] for n in first if n != shards[-1].name)  # kept, not written again
    assert not list(out.glob("*.partial"))
    progress = out / ".dsfp4-export.json"  # shards of another conversion are written again
    progress.write_text(progress.read_text().replace(Manifest.read(converted).conversion_sha256(), "0" * 64))
    export(converted, out, FORMAT, progress=False)
    third = {p.name: p.stat().st_mtime_ns for p in out.glob("model-*.safetensors")}
    assert all(third[n] != again[n] for n in again)


def test_bad_input_is_one_line(converted, v4_converted, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert_one_line_error(run_cli("export", converted, other, "--format", FORMAT), "holds something other")
    assert_one_line_error(run_cli("export", tmp_path, tmp_path / "o", "--format", FORMAT), "no manifest.json")
    r = run_cli("export", v4_converted, tmp_path / "o", "--format", FORMAT)
    assert_one_line_error(r, "DeepSeek-V4's own release layout")
    r = run_cli("export", converted, tmp_path / "o", "--format", "tensorrt")
    assert r.exit_code == 2 and "--format" in r.output


def test_an_fp8_head_is_refused_not_written_as_bytes_an_engine_would_misread(checkpoints, tmp_path):
    head8 = tmp_path / "head8"
    convert(checkpoints["fp8"], head8, ConvertOptions(head="fp8"), progress=False)
    r = run_cli("export", head8, tmp_path / "o", "--format", FORMAT)
    assert_one_line_error(r, "head.weight is stored as fp8_e4m3_b128 (convert --head fp8)")
    assert not (tmp_path / "o").exists()


def test_layers_engines_fuse_must_share_format_and_global_scale(checkpoints, tmp_path):
    mixed = tmp_path / "mixed"
    convert(checkpoints["fp8"], mixed, ConvertOptions(backbone="fp4:wq_a"), progress=False)
    r = run_cli("export", mixed, tmp_path / "o1", "--format", FORMAT)
    assert_one_line_error(r, "attn.wq_a and attn.wkv_a are stored as nvfp4 and fp8_e4m3_b128")
    fp4 = tmp_path / "fp4"
    convert(checkpoints["fp8"], fp4, ConvertOptions(backbone="fp4"), progress=False)
    m = Manifest.read(fp4)
    with safe_open(fp4 / m.tensors["layers.1.attn.wq_a"].file, "pt") as f:  # the converter pairs them
        q, kv = (f.get_tensor(m.tensors[f"layers.1.attn.{x}"].tensors["scale_2"]) for x in ("wq_a", "wkv_a"))
    assert torch.equal(q, kv)
    export(fp4, tmp_path / "o2", FORMAT, progress=False)
    theirs, _, _ = _theirs(tmp_path / "o2")
    ours = dsfp4_matrices(fp4, m)
    name = "model.layers.1.self_attn.q_a_proj"
    torch.testing.assert_close(theirs[name].float(), ours[name], rtol=2**-7, atol=0)


def test_gate_and_up_must_share_their_global_scale():
    parts = {"scale_2": torch.tensor([0.5, 0.25, 1.0])}
    with pytest.raises(FormatError, match="layer 3 expert 7: gate and up have different NVFP4 global scales"):
        _global(parts, 0, 3, 7)
    assert _global(parts, 2, 3, 7) == 1.0
