"""Cold recipes (layout/recipe.py): the text form and its refusals, records whose matrices keep different bits
(every combination, both formats, the kernel's path against the reference), and the manifest that says so per layer
(layout version 2 only where version 1 cannot say it)."""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch

from dsfp4.errors import ConfigError, ManifestError
from dsfp4.kernels.fp4 import widen as widen_module
from dsfp4.layout import manifest as manifest_module
from dsfp4.layout.cold import cold_luts
from dsfp4.layout.manifest import MANIFEST_NAME, Manifest
from dsfp4.layout.recipe import EXACT, MATRICES, RECIPE_BITS, ColdRecipe, parse_recipe, recipe_of
from dsfp4.layout.record import RecordLayout
from tests.fixtures.moe_records import quantized_record
from tests.layout.test_layout import DATA

GEN = torch.Generator().manual_seed(0)
# every (gate, up, down) a recipe may give a record: each of 2, 3, 4 bits, not all 4
EVERY_BITS = [b for b in itertools.product(RECIPE_BITS, repeat=3) if b != EXACT]


@pytest.mark.parametrize(
    "text, bits, layers",
    [
        ("all=2", (2, 2, 2), ()),
        ("gate=2,up=2,down=3", (2, 2, 3), ()),
        (" down=4 , all=2 ", (2, 2, 2), ()),  # later names win: all=2 sets down too
        ("gate=2,up=2,down=3;1-2:down=4;4:all=3", (2, 2, 3), ((1, (2, 2, 4)), (2, (2, 2, 4)), (4, (3, 3, 3)))),
        ("all=2;1:all=2", (2, 2, 2), ()),  # an override that changes nothing is none
    ],
)
def test_recipes_parse_and_print_back(text, bits, layers):
    r = ColdRecipe.parse(text)
    assert (r.bits, r.layers) == (bits, layers)
    assert ColdRecipe.parse(str(r)) == r
    assert r.of(1) == dict(layers).get(1, bits) and r.of(99) == bits


@pytest.mark.parametrize(
    "text, says",
    [
        ("gate=2", "names no bits for up and down"),
        ("gate=5,up=2,down=2", "gate takes 2, 3 or 4 bits"),
        ("gate:2", "is not MATRIX=BITS"),
        ("all=4", "narrows nothing"),
        ("all=4;1:down=4", "narrows nothing"),
        ("all=2;x:down=3", "is not a MoE block N or a range A-B"),
        ("all=2;3-1:down=3", "ends before it starts"),
        ("all=2;1:down=3;1-2:gate=3", "block 1 is named by two overrides"),
        ("all=2;1", "is not LAYERS:SPEC"),
    ],
)
def test_bad_recipes_are_refused_in_one_line_naming_the_flag_and_an_example(text, says):
    with pytest.raises(ConfigError, match=says) as e:
        parse_recipe(text)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--cold-recipe {text!r}: ") and "e.g. --cold-recipe gate=2" in msg


def test_overrides_must_name_layers_a_repack_narrows():
    ColdRecipe.parse("all=2;1-2:down=3").check_layers({1, 2})
    with pytest.raises(ConfigError, match="overrides block 3, .* name only 1, 2"):
        ColdRecipe.parse("all=2;3:down=3").check_layers({1, 2})


def test_recipe_of_layers_takes_the_most_common_bits_as_its_base():
    r = recipe_of({1: (2, 2, 3), 2: (2, 2, 4), 3: (2, 2, 3)})
    assert r == ColdRecipe((2, 2, 3), ((2, (2, 2, 4)),))
    assert recipe_of({2: (2, 2, 4), 1: (2, 2, 3)}).bits == (2, 2, 3)  # a tie: the lowest block's


def _record(fmt: str, dim: int = 256, inter: int = 96) -> tuple[RecordLayout, torch.Tensor]:
    return quantized_record(fmt, GEN, dim, inter)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_every_recipe_record_holds_each_matrix_as_narrowing_it_alone_predicts(fmt, monkeypatch):
    """For each (gate, up, down): the record narrows to its layout's size, each matrix reads back as that matrix
    narrowed at its own bits alone (4: exactly as stored), the layout survives the manifest's dict, a reader of one
    matrix's spans sees the same, and the kernel's path of widen_record (the Triton interpreter) writes the
    reference's bytes."""
    layout, record = _record(fmt)
    alone = {b: layout.narrow(record, b) for b in (2, 3)}
    monkeypatch.setattr(widen_module, "use_kernels", lambda t: True)  # the kernel path on the CPU
    sizes = {}
    for bits in EVERY_BITS:
        cold = layout.cold_of(bits)
        narrowed = layout.narrow(record, bits)
        assert narrowed.numel() == cold.nbytes < layout.nbytes and cold.cold and cold.wide() == layout
        assert RecordLayout.from_dict(json.loads(json.dumps(cold.to_dict()))) == cold
        sizes[bits] = cold.nbytes
        wide = cold.widen(narrowed)
        for k, m in enumerate(MATRICES):
            want = layout.matrix(record, m) if bits[k] == 4 else layout.cold_of(bits[k]).matrix(alone[bits[k]], m)
            assert torch.equal(cold.matrix(narrowed, m), want), (bits, m)
            assert torch.equal(layout.matrix(wide, m), want), (bits, m)
            spans = cold.stored_from(lambda at, n, raw=narrowed: raw[at : at + n], m)
            assert all(torch.equal(a, b) for a, b in zip(spans, layout.stored(wide, m), strict=True))
        got = torch.full((layout.nbytes + 64,), 7, dtype=torch.uint8)
        widen_module.widen_record(narrowed, got, cold, cold_luts())
        for p in layout.parts:  # each part as the reference widens it; padding and what follows left alone
            assert torch.equal(got[p.offset : p.offset + p.nbytes], wide[p.offset : p.offset + p.nbytes]), (bits, p)
        assert bool((got[layout.nbytes :] == 7).all()), bits
    assert sizes[(2, 2, 2)] == min(sizes.values()) and sizes[(3, 3, 3)] < sizes[(4, 4, 3)]


def test_a_manifest_with_one_width_stays_version_1_and_a_recipe_is_version_2(tmp_path):
    """Version 1 readers keep reading what they can; per-layer layouts say version 2, which version 1's rule refuses
    with "upgrade dsfp4"; a golden version 2 manifest still loads, byte for byte."""
    m = Manifest.read(_golden_v2(tmp_path))
    assert m.version == 2 and m.experts[1].cold_record.code_bits == (2, 2, 3)
    assert m.experts[2].cold_record.code_bits == (2, 2, 4) and m.cold_recipe() == ColdRecipe.parse(
        "gate=2,up=2,down=3;2:down=4"
    )
    assert m.to_json() == (DATA / "manifest_v2.json").read_bytes()
    d = json.loads(m.to_json())
    assert "cold_record" not in d["experts"] and d["experts"]["layers"]["1"]["cold_record"]["code_bits"] == [2, 2, 3]
    # the same cold experts at one width: version 1, one shared layout, as before recipes
    same = {b: _with_layout(ef, m.record.cold_of(3)) for b, ef in m.experts.items()}
    uniform = json.loads(manifest_module.dataclasses.replace(m, experts=same).to_json())
    assert uniform["format_version"] == 1 and uniform["experts"]["cold_record"]["code_bits"] == 3
    assert all("cold_record" not in e for e in uniform["experts"]["layers"].values())
    assert m.exact_sha256() == manifest_module.dataclasses.replace(m, experts=same).exact_sha256()


def test_a_version_1_reader_refuses_a_recipe_manifest_and_version_2_content_must_say_so(tmp_path, monkeypatch):
    model = _golden_v2(tmp_path)
    monkeypatch.setattr(manifest_module, "MANIFEST_VERSION", 1)  # the rule a version 1 reader applies
    with pytest.raises(ManifestError, match="layout version 2, this dsfp4 reads 1 to 1: upgrade dsfp4"):
        Manifest.read(model)
    monkeypatch.undo()
    d = json.loads((model / MANIFEST_NAME).read_text())
    d["format_version"] = 1
    (model / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ManifestError, match="format_version 1, but what it holds is layout version 2's"):
        Manifest.read(model)


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda d: d["layers"]["1"]["cold_record"].update(code_bits=[2, 2, 5]), "code_bits \\[2, 2, 5\\]"),
        (lambda d: d["layers"]["1"]["cold_record"].update(code_bits=[4, 4, 4]), "some below 4"),
        (lambda d: d["layers"]["1"]["cold_record"].update(code_bits=[2, 2]), "one per matrix"),
        (lambda d: d["layers"]["1"]["cold_record"].update(nbytes=4096), "not the \\(2, 2, 3\\)-bit cold layout"),
        (lambda d: d["layers"]["1"].pop("cold_record"), "no cold_record says their layout"),
    ],
)
def test_a_damaged_per_layer_layout_is_refused_naming_it(tmp_path, change, says):
    model = _golden_v2(tmp_path)
    d = json.loads((model / MANIFEST_NAME).read_text())
    change(d["experts"])
    (model / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ManifestError, match=says):
        Manifest.read(model)


def _golden_v2(tmp_path):
    shutil.copy(DATA / "manifest_v2.json", tmp_path / MANIFEST_NAME)
    return tmp_path


def _with_layout(ef, layout):
    return manifest_module.dataclasses.replace(ef, cold_record=layout if ef.cold else None)
