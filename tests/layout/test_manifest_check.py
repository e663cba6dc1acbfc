"""The manifest checked against its model shape and its files when a model is opened: every damage the fault run
found fails in one line naming the layer and file, for run, eval, export and verify alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dsfp4.errors import ChecksumError, ManifestError
from dsfp4.layout.manifest import MANIFEST_NAME, Manifest
from tests.fixtures.cli import assert_one_line_error, run_cli


def _edit(model: Path, change) -> None:
    d = json.loads((model / MANIFEST_NAME).read_text())
    change(d)
    (model / MANIFEST_NAME).write_text(json.dumps(d))


def _layer(d: dict) -> dict:
    return d["experts"]["layers"]["2"]


DAMAGES = {  # case -> (edit of the manifest, what the one-line error names)
    "record dim": (lambda d: d["experts"]["record"].update(dim=128), "experts.record.dim is 128, the model's is 256"),
    "record inter_dim": (lambda d: d["experts"]["record"].update(inter_dim=64), "experts.record.inter_dim is 64"),
    "record nbytes": (lambda d: d["experts"]["record"].update(nbytes=4096), "does not lay out a nvfp4 record"),
    "record format": (lambda d: d["experts"]["record"].update(format="fp8"), "experts.record.format"),
    "offsets short": (lambda d: _layer(d)["offsets"].pop(), "layers.2 (experts/layer-002.bin): offsets lists 7"),
    "sha256 short": (lambda d: _layer(d)["sha256"].pop(), "layers.2 (experts/layer-002.bin): sha256 lists 7"),
    "negative offset": (
        lambda d: _layer(d)["offsets"].__setitem__(3, -4096),
        "experts.layers.2 (experts/layer-002.bin): expert 3's offset -4096 is negative",
    ),
    "unaligned offset": (lambda d: _layer(d)["offsets"].__setitem__(3, 45057), "not a multiple of 4096"),
    "overlapping offsets": (
        lambda d: _layer(d)["offsets"].__setitem__(3, _layer(d)["offsets"][2]),
        "the records of experts 2 and 3 overlap",
    ),
    "layer missing": (lambda d: d["experts"]["layers"].pop("2"), "no entry for MoE layer 2"),
    "dense layer listed": (
        lambda d: d["experts"]["layers"].__setitem__("0", _layer(d)),
        "experts.layers.0 is not a MoE layer",
    ),
    "file outside": (lambda d: _layer(d).update(file="../x.bin"), "is not a path inside the model folder"),
    "cold expert unknown": (lambda d: _layer(d).update(cold=[9], source_sha256=["0" * 64]), "cold lists experts"),
}


@pytest.fixture
def model(converted, tmp_path) -> Path:
    return Path(shutil.copytree(converted, tmp_path / "model"))


@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_a_manifest_that_disagrees_with_its_model_is_refused_on_open(model, case):
    change, needle = DAMAGES[case]
    _edit(model, change)
    with pytest.raises(ManifestError) as e:
        Manifest.open(model)
    assert needle in str(e.value) and str(model / MANIFEST_NAME) in str(e.value) and "\n" not in str(e.value)


def test_junk_appended_to_an_expert_file_is_refused_on_open(model):
    with (model / "experts/layer-002.bin").open("ab") as f:
        f.write(b"junk")
    with pytest.raises(ChecksumError, match="layer-002.bin \\(experts of layer 2\\).*4 bytes longer"):
        Manifest.open(model)
    assert_one_line_error(run_cli("verify", model, "-q"), "layer-002.bin", "4 bytes longer")


def test_verify_names_the_file_and_layer_of_a_negative_offset(model):
    _edit(model, DAMAGES["negative offset"][0])
    assert_one_line_error(run_cli("verify", model, "-q"), "experts/layer-002.bin", "experts.layers.2", "negative")


def test_run_eval_and_export_refuse_a_hand_edited_record_dim(model, tmp_path):
    _edit(model, DAMAGES["record dim"][0])
    text = tmp_path / "t.txt"
    text.write_text("some words to score " * 20)
    needle = "experts.record.dim is 128"
    assert_one_line_error(run_cli("run", model, "--prompt", "hi", "--device", "cpu", "-q"), needle)
    assert_one_line_error(run_cli("eval", model, "--text", text, "--device", "cpu", "--context", "16"), needle)
    out = tmp_path / "ct"
    assert_one_line_error(run_cli("export", model, out, "--format", "compressed-tensors"), needle)
    assert not out.exists()
