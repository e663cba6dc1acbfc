"""--backbone specs (convert/backbone.py): which matrices each puts in NVFP4, and one-line errors for the rest."""

from __future__ import annotations

import pytest

from dsfp4.convert.backbone import FP4, FP8, KINDS, backbone_format, fp4_kinds, matrix_kind
from dsfp4.errors import ConfigError

REFS = {
    "layers.0.attn.wq_a": "wq_a",
    "layers.5.attn.wq_b": "wq_b",
    "layers.5.attn.wq": "wq_b",
    "layers.1.attn.wkv_a": "wkv_a",
    "layers.1.attn.wkv_b": "wkv_b",
    "layers.60.attn.wo": "wo",
    "layers.0.ffn.w1": "dense",
    "layers.2.ffn.w3": "dense",
    "layers.3.ffn.shared_experts.w2": "shared",
    "layers.3.ffn.gate.weight": None,
    "layers.3.attn_norm.weight": None,
    "embed.weight": None,
    "layers.61.eh_proj": None,
}


def test_every_kind_is_found_by_name_and_nothing_else_is():
    assert {r: matrix_kind(r) for r in REFS} == REFS
    assert set(REFS.values()) - {None} == set(KINDS)


@pytest.mark.parametrize(
    "spec,fp4",
    [("fp8", set()), ("fp4", set(KINDS)), ("fp4:wo,wq_b,shared", {"wo", "wq_b", "shared"}), ("fp4:dense", {"dense"})],
)
def test_a_spec_puts_its_kinds_in_nvfp4_and_the_rest_in_fp8(spec, fp4):
    assert fp4_kinds(spec) == fp4
    for ref, kind in REFS.items():
        if kind is not None:
            assert backbone_format(ref, spec) == (FP4 if kind in fp4 else FP8), (spec, ref)
    assert backbone_format("layers.0.attn.wo_a", spec) == (FP4 if spec == "fp4" else FP8)  # V4's, of no kind


@pytest.mark.parametrize("spec", ["fp16", "fp4:", "fp4:wo,attn", "fp8:wo", "FP4"])
def test_a_bad_spec_is_one_line_naming_the_flag_and_the_kinds(spec):
    with pytest.raises(ConfigError, match=r"--backbone .*give fp8, fp4 or fp4:KIND,KIND\.\.\. with kinds wq_a"):
        fp4_kinds(spec)


def test_a_mixed_backbone_converts_records_each_format_and_runs(checkpoints, tmp_path):
    from dsfp4.convert.pipeline import convert
    from dsfp4.convert.plan import ConvertOptions
    from dsfp4.layout.manifest import Manifest
    from dsfp4.runtime.engine import Engine

    out = tmp_path / "mix"
    convert(checkpoints["fp8"], out, ConvertOptions(backbone="fp4:wo,shared"), progress=False)
    m = Manifest.read(out)
    assert m.options["backbone"] == "fp4:wo,shared"
    formats = {ref: t.format for ref, t in m.tensors.items() if matrix_kind(ref)}
    assert formats and all((f == FP4) == (matrix_kind(r) in ("wo", "shared")) for r, f in formats.items())
    with Engine(out, device="cpu", max_context=64) as engine:
        assert len(engine.generate([0, 5, 9], max_tokens=4, temperature=0).token_ids) == 4


def test_the_whole_v3_plans_each_spec_with_what_does_not_fit_in_ram():
    from dsfp4.tools.projection import MACHINES, full_plan

    on_16g = full_plan("v3", MACHINES["16g"], "fp4:wo")[1]
    assert on_16g.on_host.embed and on_16g.host_backbone > 0  # 1.3 GiB short of the device: the embedding and more
    assert full_plan("v3", MACHINES["16g"], "fp4")[1].host_backbone == 0
    slots = [full_plan("v3", MACHINES["24g"], spec)[1].gpu_slots for spec in ("fp8", "fp4:wo", "fp4:wo,wq_b", "fp4")]
    assert slots == sorted(slots) and slots[0] < slots[-1]  # each kind in NVFP4 leaves room for more expert slots
