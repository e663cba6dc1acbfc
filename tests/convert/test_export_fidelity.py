"""What an export passes on (convert/export/fidelity.py): a cold-repacked model is refused in one line naming its cold
records and the fix, or exported with --accept-cold-loss, its widened records labelled in the metadata; a damaged
record or backbone file stops every format's export as `run` stops, naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dsfp4.convert.export.fidelity import COLD_KEY
from dsfp4.convert.export.gguf import COLD_METADATA
from dsfp4.convert.export.writer import INDEX
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.recipe import ColdRecipe
from dsfp4.layout.repack import Cold, repack
from tests.fixtures.cli import assert_one_line_error, run_cli

gguf = pytest.importorskip("gguf")
# each format, with the fixture whose experts it exports as stored
FORMATS = [("compressed-tensors", "converted"), ("modelopt", "converted"), ("gguf", "mxfp4_converted")]


def _copy(model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model, tmp_path / "model"))


def _cold(model: Path, bits: int | ColdRecipe = 2) -> Manifest:
    """Repack `model` with half of each main MoE layer's experts narrowed to cold codes of `bits` (or a recipe)."""
    m = Manifest.read(model)
    rng = np.random.default_rng(1)
    counts = {layer: tuple(int(c) for c in rng.permutation(8) * 3) for layer in (1, 2)}
    HotProfile(m.conversion_sha256(), 12, counts).write(model / HOT_NAME)
    repack(model, HotProfile.read(model / HOT_NAME), cold=Cold(bits, 0.5))
    return Manifest.read(model)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fmt, fixture", FORMATS)
def test_a_cold_repacked_model_is_refused_naming_its_cold_records_and_the_fix(fmt, fixture, request, tmp_path):
    model = _copy(request.getfixturevalue(fixture), tmp_path)
    m = _cold(model)
    first = min(layer for layer, ef in m.experts.items() if ef.cold)
    experts = ", ".join(map(str, m.experts[first].cold))
    for flags in ((), ("--dry-run",)):
        r = run_cli("export", model, tmp_path / "out", "--format", fmt, *flags)
        assert_one_line_error(r, "8 of 24 expert records are cold", "2-bit codes", f"layer {first}: experts {experts}")
        assert_one_line_error(
            r, "convert again and export before a --cold-bits or --cold-recipe repack", "--accept-cold-loss"
        )
        assert not (tmp_path / "out").exists()


def test_accepted_cold_records_are_exported_widened_with_their_loss_and_labelled(converted, tmp_path):
    exact = tmp_path / "exact"
    r = run_cli("export", converted, exact, "--format", "compressed-tensors", "-q", "--accept-cold-loss")
    assert r.exit_code == 0 and f"note: --accept-cold-loss: {converted} has no cold records: exact" in r.stderr
    model = _copy(converted, tmp_path)
    m = _cold(model)
    out = tmp_path / "out"
    r = run_cli("export", model, out, "--format", "compressed-tensors", "-q", "--accept-cold-loss")
    assert r.exit_code == 0, r.output
    assert "note: --accept-cold-loss: 8 of 24 routed expert records were narrowed to 2-bit codes" in r.stderr
    label = json.loads((out / "config.json").read_text())[COLD_KEY]
    assert label["code_bits"] == 2 and label["records"] == 8 and label["of"] == 24
    assert label["experts"] == {str(layer): list(ef.cold) for layer, ef in m.experts.items() if ef.cold}
    ours, theirs = (
        {k: v for f in sorted(d.glob("model-*.safetensors")) for k, v in load_file(f).items()} for d in (out, exact)
    )
    layer = min(int(k) for k in label["experts"])
    cold, hot = m.experts[layer].cold[0], next(e for e in range(8) if e not in m.experts[layer].cold)
    name = f"model.layers.{layer}.mlp.experts.{{}}.gate_proj.weight_packed"
    assert torch.equal(ours[name.format(hot)], theirs[name.format(hot)])  # a hot record is exported exactly
    assert not torch.equal(ours[name.format(cold)], theirs[name.format(cold)])  # a cold one carries its loss


def test_accepted_cold_records_are_labelled_in_the_gguf(mxfp4_converted, tmp_path):
    model = _copy(mxfp4_converted, tmp_path)
    m = _cold(model, bits=3)
    r = run_cli("export", model, tmp_path / "out", "--format", "gguf", "-q", "--accept-cold-loss")
    assert r.exit_code == 0, r.output
    field = gguf.GGUFReader(tmp_path / "out" / "model.gguf").fields[COLD_METADATA]
    label = json.loads(bytes(field.parts[field.data[0]]).decode())
    assert label["code_bits"] == 3 and label["experts"] == {
        str(k): list(v.cold) for k, v in m.experts.items() if v.cold
    }


def test_a_cold_recipe_is_labelled_with_each_layers_bits_and_the_stored_bits(converted, tmp_path):
    model = _copy(converted, tmp_path)
    m = _cold(model, ColdRecipe.parse("gate=2,up=2,down=3;2:down=4"))
    r = run_cli("export", model, tmp_path / "refused", "--format", "modelopt")
    assert_one_line_error(r, "codes of the cold recipe gate=2,up=2,down=3;2:down=4", "--accept-cold-loss")
    out = tmp_path / "out"
    r = run_cli("export", model, out, "--format", "compressed-tensors", "-q", "--accept-cold-loss")
    assert r.exit_code == 0, r.output
    label = json.loads((out / "config.json").read_text())[COLD_KEY]
    assert "code_bits" not in label and label["recipe"] == "gate=2,up=2,down=3;2:down=4"
    assert label["code_bits_by_layer"] == {"1": [2, 2, 3], "2": [2, 2, 4]}
    exact = m.record.nbytes * 24 * 8 / (24 * 3 * m.record.dim * m.record.inter_dim)
    assert label["stored_bits_per_routed_weight"] == round(m.routed_bits(), 3) < exact


@pytest.mark.parametrize("fmt, fixture", FORMATS)
def test_a_record_with_a_flipped_byte_stops_the_export_naming_it(fmt, fixture, request, tmp_path):
    model = _copy(request.getfixturevalue(fixture), tmp_path)
    m = Manifest.read(model)
    ef = m.experts[2]
    _flip(model / ef.file, ef.offsets[5] + 100)
    r = run_cli("export", model, tmp_path / "out", "--format", fmt, "-q")
    assert_one_line_error(r, f"{model / ef.file}: the record of expert 5 (layer 2) fails its sha256 check")
    assert_one_line_error(r, "convert again")
    # no export: what was written before the damaged record stays, for a rerun once the model is whole again
    assert not (tmp_path / "out" / INDEX).exists() and not (tmp_path / "out" / "model.gguf").exists()


@pytest.mark.parametrize("fmt, fixture", FORMATS)
def test_a_backbone_file_with_a_flipped_byte_is_refused_before_out_is_touched(fmt, fixture, request, tmp_path):
    model = _copy(request.getfixturevalue(fixture), tmp_path)
    rel = Manifest.read(model).backbone_files()[-1]
    _flip(model / rel, (model / rel).stat().st_size - 1)  # a tensor's last byte: the header still reads
    r = run_cli("export", model, tmp_path / "out", "--format", fmt, "-q")
    assert_one_line_error(r, f"{model / rel}: sha256 mismatch", "convert again")
    assert not (tmp_path / "out").exists()
