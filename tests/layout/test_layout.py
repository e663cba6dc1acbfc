"""Layout v1 invariants: record layout and alignment, safetensors writer, manifest schema and versions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsfp4.errors import FormatError, ManifestError, SourceError
from dsfp4.layout.manifest import MANIFEST_NAME, Manifest
from dsfp4.layout.record import PART_ALIGN, RECORD_ALIGN, RecordLayout
from dsfp4.layout.safetensors_file import SafetensorsWriter, read_header

DATA = Path(__file__).parents[1] / "data"


def test_v3_record_sizes_match_the_spec():
    nv = RecordLayout.for_expert("nvfp4", 7168, 2048)
    assert nv.nbytes == 24_776_704  # checkpoint-spec b.4, 4 KiB-aligned
    assert [p.name for p in nv.parts] == ["w13", "w13_scale", "w2", "w2_scale", "scale_2"]
    assert nv.part("w13").shape == (4096, 3584) and nv.part("w2_scale").shape == (7168, 128)
    assert RecordLayout.for_expert("mxfp4", 7168, 2048).nbytes == 23_396_352
    for layout in (nv, RecordLayout.for_expert("mxfp4", 256, 96)):
        assert layout.nbytes % RECORD_ALIGN == 0 and all(p.offset % PART_ALIGN == 0 for p in layout.parts)
    with pytest.raises(FormatError, match="nvfp4 or mxfp4"):
        RecordLayout.for_expert("fp8_e4m3_b128", 256, 96)


def test_record_pack_unpack_round_trip_and_type_checks():
    layout = RecordLayout.for_expert("nvfp4", 256, 96)
    g = torch.Generator().manual_seed(0)
    parts = {p.name: torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=g) for p in layout.parts}
    parts["w13_scale"] = parts["w13_scale"].view(torch.float8_e4m3fn)
    parts["w2_scale"] = parts["w2_scale"].view(torch.float8_e4m3fn)
    parts["scale_2"] = torch.rand(3, generator=g)
    buf = layout.pack(parts)
    assert len(buf) == layout.nbytes and buf[-16:] == bytes(16)
    back = layout.unpack(buf)
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in parts.items())
    assert RecordLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(FormatError, match="record part w2"):
        layout.pack({**parts, "w2": parts["w2"].float()})


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_one_matrix_read_from_its_spans_alone_is_what_the_whole_record_gives(fmt):
    layout = RecordLayout.for_expert(fmt, 256, 96)
    raw = bytes(torch.randint(0, 256, (layout.nbytes,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8))
    asked = []

    def read(at: int, n: int) -> bytes:
        asked.append(n)
        return raw[at : at + n]

    for which in ("w1", "w3", "w2"):
        whole, alone = layout.stored(raw, which), layout.stored_from(read, which)
        assert all(
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            for a, b in zip(whole, alone, strict=True)
        )
        assert [tuple(a.shape) for a in alone] == [tuple(b.shape) for b in whole]
    weights = sum(p.nbytes for p in layout.parts)
    assert sum(asked) == weights  # the three matrices read every byte of the parts once, nothing twice


def test_writer_output_is_order_independent_and_loads_with_safetensors(tmp_path):
    entries = [("a", "F32", (3, 5)), ("b", "BF16", (7,)), ("c", "U8", (9, 2)), ("s", "F32", ())]
    values = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).bfloat16(),
        "c": torch.arange(18, dtype=torch.uint8).view(9, 2),
        "s": torch.tensor(2.5),
    }
    for name, order in (("x", "abcs"), ("y", "scba")):
        w = SafetensorsWriter(tmp_path / f"{name}.safetensors", entries)
        for k in order:
            w.write(k, values[k])
        w.close()
    assert (tmp_path / "x.safetensors").read_bytes() == (tmp_path / "y.safetensors").read_bytes()
    loaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in values.items())
    w = SafetensorsWriter(tmp_path / "z.safetensors", entries)
    with pytest.raises(ValueError, match="never written"):
        w.close()


def test_read_header_rejects_garbage_and_truncation(tmp_path):
    (tmp_path / "g.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(SourceError, match="truncated or not a safetensors file"):
        read_header(tmp_path / "g.safetensors")
    w = SafetensorsWriter(tmp_path / "t.safetensors", [("a", "F32", (100,))])
    w.write("a", torch.zeros(100))
    w.close()
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-4])
    with pytest.raises(SourceError, match="truncated: tensor a"):
        read_header(tmp_path / "t.safetensors")


def test_golden_v1_manifest_still_loads(tmp_path):
    shutil.copy(DATA / "manifest_v1.json", tmp_path / MANIFEST_NAME)
    m = Manifest.read(tmp_path)
    assert m.version == 1 and m.record.format == "nvfp4" and m.args.family == "deepseek_v3"
    assert m.tensors["layers.1.attn.wkv_a"].shape == (160, 256)
    assert Manifest.read(tmp_path).to_json() == (DATA / "manifest_v1.json").read_bytes()


@pytest.mark.parametrize(("version", "message"), [(3, "upgrade dsfp4"), (0, "convert the model again")])
def test_other_manifest_versions_are_refused(tmp_path, version, message):
    d = json.loads((DATA / "manifest_v1.json").read_text())
    d["format_version"] = version
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ManifestError, match=message):
        Manifest.read(tmp_path)


def test_malformed_manifest_is_refused(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text('{"format_version": 1}')
    with pytest.raises(ManifestError, match="malformed manifest"):
        Manifest.read(tmp_path)


def _golden() -> dict:
    return json.loads((DATA / "manifest_v1.json").read_text())


def _damaged(case: str) -> bytes:
    """A damaged manifest.json, one per way the issue found and a few more of each kind."""
    d = _golden()
    if case == "random bytes":
        return bytes(range(256)) * 4
    if case in ("[1,2,3]", "null", "7", '"text"'):
        return case.encode()
    if case == "tensors: []":
        d["tensors"] = []
    elif case == "layer key not a number":
        d["experts"]["layers"]["one"] = d["experts"]["layers"].pop(next(iter(d["experts"]["layers"])))
    elif case == "shape of strings":
        next(iter(d["tensors"].values()))["shape"] = ["a", "b"]
    elif case == "offsets null":
        next(iter(d["experts"]["layers"].values()))["offsets"] = None
    elif case == "model dim a string":
        d["model"]["dim"] = "256"
    elif case == "record parts missing":
        del d["experts"]["record"]["parts"]
    elif case == "files nbytes true":
        next(iter(d["files"].values()))["nbytes"] = True
    return json.dumps(d).encode()


DAMAGED = {  # case -> what the one-line error says
    "random bytes": "not valid JSON",
    "[1,2,3]": "(a list, not an object)",
    "null": "(null, not an object)",
    "7": "(an integer, not an object)",
    '"text"': "(a string, not an object)",
    "tensors: []": "at tensors: expected an object, found a list",
    "layer key not a number": "key 'one' is not a layer number",
    "shape of strings": "shape[0]: expected an integer, found a string",
    "offsets null": "offsets: expected a list of integers, found null",
    "model dim a string": "model.dim: expected an integer, found a string",
    "record parts missing": "experts.record.parts: missing",
    "files nbytes true": "nbytes: expected an integer, found a boolean",
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_manifest_is_refused_in_one_line(tmp_path, case):
    (tmp_path / MANIFEST_NAME).write_bytes(_damaged(case))
    with pytest.raises(ManifestError) as e:
        Manifest.read(tmp_path)
    message = str(e.value)
    assert DAMAGED[case] in message and "\n" not in message and str(tmp_path) in message


def test_the_schema_accepts_what_the_writer_writes():
    from dsfp4.layout.manifest_schema import check_manifest

    assert check_manifest(_golden()) is None
    assert check_manifest({**_golden(), "skipped": {"x": "1"}}) == "skipped.x: expected an integer, found a string '1'"
