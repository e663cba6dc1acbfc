"""dsfp4 convert on tiny checkpoints: layout invariants, exactness against the source, options, resume."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import dsfp4.convert.pipeline as pipeline
from dsfp4.convert.plan import ConvertOptions
from dsfp4.convert.source.checkpoint import SourceCheckpoint
from dsfp4.errors import SourceError
from dsfp4.layout import fp4, fp8
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.record import RECORD_ALIGN
from tests.fixtures.files import reshard, tree_bytes
from tests.fixtures.reference import hf_name


def _record(model, layer, expert):
    m = Manifest.read(model)
    ef = m.experts[layer]
    with open(model / ef.file, "rb") as f:
        f.seek(ef.offsets[expert])
        return m.record, f.read(m.record.nbytes)


def _stored(model, entry, comp):
    with safe_open(model / entry.file, "pt") as f:
        return f.get_tensor(entry.tensors[comp])


@pytest.mark.slow
def test_records_are_aligned_and_cover_every_expert(converted):
    m = Manifest.read(converted)
    a = m.args
    assert sorted(m.experts) == [b for b in range(a.n_blocks) if a.is_moe_layer(b)]
    assert m.record.nbytes % RECORD_ALIGN == 0
    for ef in m.experts.values():
        assert len(ef.offsets) == a.n_routed_experts
        assert all(o % RECORD_ALIGN == 0 for o in ef.offsets)
        assert (converted / ef.file).stat().st_size == len(ef.offsets) * m.record.nbytes


def test_every_record_is_the_nvfp4_quantization_of_the_fp8_dequantized_source(checkpoints, converted):
    m = Manifest.read(converted)
    with SourceCheckpoint(checkpoints["fp8"]) as src:
        for layer, ef in m.experts.items():
            for e in range(len(ef.offsets)):
                layout, rec = _record(converted, layer, e)
                p = f"model.layers.{layer}.mlp.experts.{e}."
                dense = {}
                for proj in ("gate", "up", "down"):
                    w = src.read(p + f"{proj}_proj.weight")
                    dense[proj] = fp8.fp8_block_dequantize(w, src.read(p + f"{proj}_proj.weight_scale_inv"))
                amax = torch.maximum(dense["gate"].float().abs().max(), dense["up"].float().abs().max())
                w1, w3, w2 = layout.dequantize(rec)
                assert torch.equal(w1, fp4.nvfp4_dequantize(*fp4.nvfp4_quantize(dense["gate"], amax=amax)))
                assert torch.equal(w3, fp4.nvfp4_dequantize(*fp4.nvfp4_quantize(dense["up"], amax=amax)))
                assert torch.equal(w2, fp4.nvfp4_dequantize(*fp4.nvfp4_quantize(dense["down"])))


def test_backbone_tensors_are_bit_identical_to_the_source(checkpoints, converted):
    m = Manifest.read(converted)
    n_fp8 = 0
    with SourceCheckpoint(checkpoints["fp8"]) as src:
        for name, entry in m.tensors.items():
            assert entry.format in ("fp8_e4m3_b128", "bf16", "f32"), name
            for comp in entry.tensors:
                ours = _stored(converted, entry, comp).view(torch.uint8)
                hf = _source_name(name, comp)
                assert torch.equal(ours, src.read_raw(hf).reshape(ours.shape)), name
            n_fp8 += entry.format == "fp8_e4m3_b128"
    assert n_fp8 == 8 * m.args.n_blocks  # 5 attention + 3 dense-or-shared MLP matrices per block


def _source_name(ref: str, comp: str) -> str:
    """The HF name of one stored component, from the test reference's hand-written name table."""
    hf = hf_name(ref)
    return hf if comp == "weight" else hf.removesuffix("weight") + {"scale": "weight_scale_inv"}[comp]


def test_nvfp4_source_records_hold_the_source_fp4_bytes(checkpoints, tmp_path):
    out = tmp_path / "out"
    pipeline.convert(checkpoints["nvfp4"], out, ConvertOptions(), progress=False)
    m = Manifest.read(out)
    with SourceCheckpoint(checkpoints["nvfp4"]) as src:
        for layer in range(m.args.n_dense_layers, m.args.n_layers):  # the MTP layer is BF16 in NVIDIA's export
            for e in (0, m.args.n_routed_experts - 1):
                layout, rec = _record(out, layer, e)
                parts = layout.unpack(rec)
                p = f"model.layers.{layer}.mlp.experts.{e}."
                assert torch.equal(
                    parts["w13"], torch.cat([src.read(p + "gate_proj.weight"), src.read(p + "up_proj.weight")])
                )
                assert torch.equal(parts["w2"], src.read(p + "down_proj.weight"))
                scales = torch.cat([src.read(p + "gate_proj.weight_scale"), src.read(p + "up_proj.weight_scale")])
                assert torch.equal(parts["w13_scale"].view(torch.uint8), scales.view(torch.uint8))
                g = [src.read(p + f"{q}_proj.weight_scale_2").item() for q in ("gate", "up", "down")]
                assert parts["scale_2"].tolist() == g
        # NVFP4 backbone matrices are carried over, never requantized; BF16 attention goes to FP8 blocks
        wo = m.tensors["layers.0.attn.wo"]
        assert wo.format == "nvfp4"
        assert torch.equal(_stored(out, wo, "weight"), src.read("model.layers.0.self_attn.o_proj.weight"))
        assert m.tensors["layers.0.attn.wq_a"].format == "fp8_e4m3_b128"
    assert sum(m.skipped.values()) > 0


def test_bf16_source_and_options_mxfp4_backbone_fp4(checkpoints, tmp_path):
    out = tmp_path / "out"
    pipeline.convert(checkpoints["bf16"], out, ConvertOptions(format="mxfp4", backbone="fp4"), progress=False)
    m = Manifest.read(out)
    assert m.record.format == "mxfp4" and m.options == {
        "format": "mxfp4",
        "backbone": "fp4",
        "head": "bf16",
        "mtp": True,
    }
    assert m.tensors["layers.1.attn.wkv_b"].format == "nvfp4"
    assert m.tensors["layers.3.eh_proj"].format == "bf16"  # not a matrix DeepSeek ships in FP8
    with SourceCheckpoint(checkpoints["bf16"]) as src:
        layout, rec = _record(out, 2, 3)
        w1, _, w2 = layout.dequantize(rec)
        gate = src.read("model.layers.2.mlp.experts.3.gate_proj.weight")
        assert torch.equal(w1, fp4.mxfp4_dequantize(*fp4.mxfp4_quantize(gate)))
        wkv_b = m.tensors["layers.1.attn.wkv_b"]
        stored = [_stored(out, wkv_b, c) for c in ("weight", "scale", "scale_2")]
        want = fp4.nvfp4_quantize(src.read("model.layers.1.self_attn.kv_b_proj.weight"))
        for a, b in zip(stored, want, strict=True):
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        # gate and up of one MLP share their NVFP4 global scale, from the joint amax
        w1, w3 = (src.read(f"model.layers.0.mlp.{p}_proj.weight").float() for p in ("gate", "up"))
        g = [_stored(out, m.tensors[f"layers.0.ffn.{w}"], "scale_2").item() for w in ("w1", "w3")]
        assert g[0] == g[1] == fp4.nvfp4_global_scale(torch.maximum(w1.abs().max(), w3.abs().max())).item()
    assert set(m.quant_error) == {"backbone bf16 -> nvfp4", "experts bf16 -> mxfp4"}
    assert 0.09 < m.quant_error["backbone bf16 -> nvfp4"] < 0.1


def test_no_mtp_leaves_the_mtp_layer_out(checkpoints, tmp_path):
    out = tmp_path / "out"
    pipeline.convert(checkpoints["fp8"], out, ConvertOptions(no_mtp=True), progress=False)
    m = Manifest.read(out)
    assert m.args.n_mtp_layers == 0 and max(m.experts) == m.args.n_layers - 1
    assert not any(k.startswith(f"layers.{m.args.n_layers}.") for k in m.tensors)
    assert m.skipped == {
        "MTP layer left out by --no-mtp": sum(
            1
            for k in json.loads((checkpoints["fp8"] / "model.safetensors.index.json").read_text())["weight_map"]
            if k.startswith(f"model.layers.{m.args.n_layers}.")
        )
    }


def test_no_mtp_converts_a_download_that_left_the_mtp_shard_out(checkpoints, tmp_path):
    src, n = tmp_path / "src", json.loads((checkpoints["fp8"] / "config.json").read_text())["num_hidden_layers"]
    mtp_shard = "model-mtp.safetensors"  # the MTP layer alone in its shard, as in the big releases
    reshard(
        checkpoints["fp8"],
        src,
        lambda name: mtp_shard if name.startswith(f"model.layers.{n}.") else "model.safetensors",
    )
    pipeline.convert(src, tmp_path / "full", ConvertOptions(no_mtp=True), progress=False)
    (src / mtp_shard).unlink()  # as `dsfp4 download --no-mtp` leaves it
    with pytest.raises(
        SourceError, match="missing; download it \\(if it holds only the MTP layer, convert with --no-mtp"
    ):
        pipeline.convert(src, tmp_path / "no", ConvertOptions(), progress=False)
    pipeline.convert(src, tmp_path / "part", ConvertOptions(no_mtp=True), progress=False)
    data = {k: v for k, v in tree_bytes(tmp_path / "full").items() if k.startswith(("backbone/", "experts/"))}
    assert data and {k: tree_bytes(tmp_path / "part")[k] for k in data} == data
    full, part = Manifest.read(tmp_path / "full"), Manifest.read(tmp_path / "part")
    assert part.tensors == full.tensors and part.experts == full.experts


def test_output_is_identical_for_any_number_of_workers(checkpoints, converted, tmp_path):
    out = tmp_path / "w3"
    pipeline.convert(checkpoints["fp8"], out, ConvertOptions(workers=3), progress=False)
    assert tree_bytes(out) == tree_bytes(converted)


def test_dry_run_writes_nothing(checkpoints, tmp_path):
    result = pipeline.convert(checkpoints["fp8"], tmp_path / "out", ConvertOptions(dry_run=True), progress=False)
    assert not (tmp_path / "out").exists() and not result.done
    assert result.plan.out_bytes > 0 and len(result.plan.parts) == result.plan.args.n_blocks + 1
