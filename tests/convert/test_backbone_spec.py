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
    from dsfp4.projection.machines import MACHINES
    from dsfp4.projection.whole_model import full_plan

    on_16g = full_plan("v3", MACHINES["16g"], "fp4:wo")[1]
    assert on_16g.on_host.embed and on_16g.host_backbone > 0  # 1.3 GiB short of the device: the embedding and more
    assert full_plan("v3", MACHINES["16g"], "fp4")[1].host_backbone == 0
    slots = [full_plan("v3", MACHINES["24g"], spec)[1].gpu_slots for spec in ("fp8", "fp4:wo", "fp4:wo,wq_b", "fp4")]
    assert slots == sorted(slots) and slots[0] < slots[-1]  # each kind in NVFP4 leaves room for more expert slots


def test_auto_keeps_fp8_where_the_whole_backbone_fits_and_takes_the_16g_way_where_it_does_not():
    from dsfp4.projection.backbone_choice import WAYS, choose_backbone
    from dsfp4.runtime.plan.budget import PRESETS, Budgets, GiB
    from dsfp4.synthetic.bench_model import model_args

    v3 = model_args(61, 3)[1]
    p16, p24 = PRESETS["16g"], PRESETS["24g"]
    assert choose_backbone(v3, Budgets(p24.gpu, p24.cpu, "24g"), "nvfp4", GiB // 2)[0] == "fp8"
    spec, why = choose_backbone(v3, Budgets(p16.gpu, p16.cpu, "16g"), "nvfp4", GiB // 2)
    assert spec == "fp4:wo,wq_b,shared" == WAYS[1] and "fits 16g" in why
    spec, why = choose_backbone(v3, Budgets(12 * GiB, p16.cpu, "12g"), "nvfp4", GiB // 2)
    assert spec == WAYS[-1] and "in RAM" in why  # nothing fits whole: the way with the least of it in RAM


def test_convert_cli_auto_and_head_fp8(checkpoints, tmp_path):
    from click.testing import CliRunner

    from dsfp4.cli.main import cli
    from dsfp4.layout.manifest import Manifest
    from dsfp4.runtime.engine import Engine

    out = tmp_path / "auto"
    r = CliRunner().invoke(
        cli, ["convert", "--fp4", str(checkpoints["fp8"]), str(out), "--preset", "16g", "--head", "fp8"]
    )
    assert r.exit_code == 0, r.output
    assert "--backbone auto: fp8 (the whole backbone fits preset 16g" in r.output  # the tiny model fits anything
    m = Manifest.read(out)
    assert m.options["backbone"] == "fp8" and m.options["head"] == "fp8"
    assert m.tensors["head.weight"].format == "fp8_e4m3_b128" and m.tensors["embed.weight"].format == "bf16"
    assert all(t.format == "fp8_e4m3_b128" for n, t in m.tensors.items() if n.endswith(".head.weight"))
    with Engine(out, device="cpu", max_context=64) as engine:
        assert len(engine.generate([0, 5, 9], max_tokens=4, temperature=0).token_ids) == 4
    assert "head fp8" in CliRunner().invoke(cli, ["inspect", str(out)]).output
    bad = CliRunner().invoke(
        cli, ["convert", "--fp4", str(checkpoints["fp8"]), str(tmp_path / "x"), "--preset", "16g", "--backbone", "fp8"]
    )
    assert bad.exit_code == 2 and "--preset sizes --backbone auto" in bad.output
    with pytest.raises(ConfigError, match="--head fp4: choose one of bf16, fp8"):
        from dsfp4.convert.plan import ConvertOptions

        ConvertOptions(head="fp4")
