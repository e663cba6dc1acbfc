"""Converting a DeepSeek-V4 checkpoint: recognized from config.json, experts repacked byte for byte into MXFP4
records, the FP8 backbone's E8M0 scales kept exactly (as fp32 numbers), every other tensor carried, and the
same completeness check as V3."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dsfp4.convert.names.family import map_tensors
from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from dsfp4.convert.source.checkpoint import SourceCheckpoint
from dsfp4.convert.source.hf_config import from_hf_config
from dsfp4.errors import SourceError
from dsfp4.layout.formats import FORMATS
from dsfp4.layout.fp4 import mxfp4_dequantize
from dsfp4.layout.fp8 import e8m0_scales
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.quant import dequantize
from dsfp4.layout.safetensors_file import TensorInfo
from dsfp4.layout.verify import verify


def _source(ckpt):
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]

    def read(name):
        with safe_open(ckpt / weight_map[name], "pt") as f:
            return f.get_tensor(name)

    return read


def test_manifest_records_the_family_and_every_tensor_has_a_place(v4_converted, v4_checkpoint):
    m = Manifest.read(v4_converted)
    assert m.args.family == "deepseek_v4" and m.args == from_hf_config(
        json.loads((v4_checkpoint / "config.json").read_text())
    )
    assert m.options["format"] == "mxfp4" and m.record.format == "mxfp4" and m.quant_error == {}
    a = m.args
    assert sorted(m.experts) == list(range(a.n_blocks))  # every layer is MoE, the MTP block too
    for name in (
        "layers.0.ffn.gate.tid2eid",
        "layers.2.ffn.gate.bias",
        "layers.1.attn.indexer.wq_b",
        "layers.2.attn.compressor.ape",
        "layers.1.hc_attn_fn",
        "layers.3.attn.attn_sink",
        "hc_head_fn",
        "layers.5.e_proj",
        "layers.5.hc_head_scale",
    ):
        assert name in m.tensors, name
    assert "layers.0.ffn.gate.bias" not in m.tensors and "layers.2.attn.indexer.wq_b" not in m.tensors  # HCA
    assert m.tensors["layers.0.ffn.gate.tid2eid"].format == "i64"
    report = verify(v4_converted)
    assert report.n_records == a.n_blocks * a.n_routed_experts


def test_expert_records_are_the_source_bytes(v4_converted, v4_checkpoint):
    m, read = Manifest.read(v4_converted), _source(v4_checkpoint)
    for layer, e in ((0, 0), (3, 5), (5, 7)):  # a hash layer, a scored one, the MTP block
        data = (v4_converted / m.experts[layer].file).read_bytes()
        rec = m.record.unpack(data[m.experts[layer].offsets[e] :][: m.record.nbytes])
        src = {
            w: (read(f"{p}.weight"), read(f"{p}.scale"))
            for w in ("w1", "w3", "w2")
            for p in [("mtp.0." if layer == 5 else f"layers.{layer}.") + f"ffn.experts.{e}.{w}"]
        }
        as_bytes = [t.view(torch.uint8) for t in (*src["w1"], *src["w3"], *src["w2"])]
        assert torch.equal(rec["w13"], torch.cat([as_bytes[0], as_bytes[2]]))
        assert torch.equal(rec["w13_scale"], torch.cat([as_bytes[1], as_bytes[3]]))
        assert torch.equal(rec["w2"], as_bytes[4]) and torch.equal(rec["w2_scale"], as_bytes[5])
        # and they decode to the same numbers: low nibble = even element, 2^(byte - 127) per 32 inputs
        w1, _, w2 = m.record.dequantize(data[m.experts[layer].offsets[e] :][: m.record.nbytes])
        assert torch.equal(w1, mxfp4_dequantize(as_bytes[0], as_bytes[1]))
        assert torch.equal(w2, mxfp4_dequantize(as_bytes[4], as_bytes[5]))


def test_fp8_backbone_keeps_its_bytes_and_its_power_of_two_scales(v4_converted, v4_checkpoint):
    m, read = Manifest.read(v4_converted), _source(v4_checkpoint)
    for ref, name in (("layers.1.attn.wq_b", "layers.1.attn.wq_b"), ("layers.5.h_proj", "mtp.0.h_proj")):
        t = m.tensors[ref]
        assert t.format == "fp8_e4m3_b128"
        with safe_open(v4_converted / t.file, "pt") as f:
            q, scale = (f.get_tensor(t.tensors[c]) for c, _ in FORMATS[t.format].components)
        sq, ss = read(name + ".weight"), read(name + ".scale")
        assert torch.equal(q.view(torch.uint8), sq.view(torch.uint8))
        assert torch.equal(scale, 2.0 ** (ss.view(torch.uint8).float() - 127))
        assert torch.equal(dequantize(t.format, (q, scale)), dequantize("fp8_e4m3_e8m0_b128", (sq, ss)))
    assert torch.equal(
        e8m0_scales(torch.tensor([0, 1, 127, 254], dtype=torch.uint8)),
        torch.tensor([2.0**-127, 2.0**-126, 1.0, 2.0**127]),
    )


def _infos(ckpt):
    with SourceCheckpoint(ckpt) as src:
        return src.args, {n: t.info for n, t in src.tensors.items()}


def test_completeness_check_names_the_extra_or_missing_tensor(v4_checkpoint):
    args, infos = _infos(v4_checkpoint)
    where = dict.fromkeys(infos, "model-00001.safetensors")
    extra = {**infos, "layers.1.attn.compressor.extra": TensorInfo("x", "F32", (4,), 0, 16)}
    with pytest.raises(SourceError, match=r"unexpected tensor layers\.1\.attn\.compressor\.extra"):
        map_tensors(args, extra, {**where, "layers.1.attn.compressor.extra": "s"}, "index")
    for gone in ("layers.0.ffn.gate.tid2eid", "layers.1.attn.indexer.compressor.ape", "hc_head_base"):
        missing = {n: i for n, i in infos.items() if n != gone}
        with pytest.raises(SourceError, match=f"tensor {gone} is missing"):
            map_tensors(args, missing, where, "index")
    missing_scale = {n: i for n, i in infos.items() if n != "layers.2.ffn.experts.3.w2.scale"}
    with pytest.raises(SourceError, match=r"layers\.2\.ffn\.experts\.3\.w2\.weight .*has dtype I8 but no scale"):
        map_tensors(args, missing_scale, where, "index")
    # the MTP block's copies of the embedding and head (dropped by DeepSeek's convert.py) are skipped
    head = {**infos, "mtp.0.head.weight": TensorInfo("h", "BF16", (640, 64), 0, 0)}
    tmap = map_tensors(args, head, {**where, "mtp.0.head.weight": "s"}, "index")
    assert "mtp.0.head.weight" in tmap.skipped
    # --no-mtp leaves the mtp.0. tensors out
    tmap = map_tensors(args, infos, where, "index", include_mtp=False)
    assert set(tmap.skipped) == {n for n in infos if n.startswith("mtp.0.")}


def test_nvfp4_on_request_requantizes_and_reports_the_error(v4_checkpoint, tmp_path):
    r = convert(v4_checkpoint, tmp_path / "nv", ConvertOptions(format="nvfp4", workers=1), progress=False)
    ((klass, err),) = r.quant_error.items()
    assert klass == "experts mxfp4 -> nvfp4" and 0 < err < 0.1
    m = Manifest.read(tmp_path / "nv")
    assert m.record.format == "nvfp4" and m.quant_error == r.quant_error
