"""`dsfp4 export --format gguf` (convert/export/gguf.py): the gguf package's reader finds every tensor under
llama.cpp's deepseek2 names, types and shapes; its own dequantization gives dsfp4's values exactly for the MXFP4
experts, the BF16 tables and the F32 vectors, within Q8_0's rounding for requantized matrices and F16's for the split
wkv_b; the MXFP4 repack is lossless both ways; the export resumes after an interruption and refuses what it cannot
hold with one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from dsfp4.convert.export.gguf import LAYER, PROGRESS, Source
from dsfp4.convert.export.gguf_blocks import gguf_to_mxfp4, mxfp4_to_gguf
from dsfp4.layout.fp4 import mxfp4_dequantize, mxfp4_quantize
from dsfp4.layout.manifest import Manifest
from tests.fixtures.cli import assert_one_line_error, run_cli

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def exported(mxfp4_converted, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "out"
    r = run_cli("export", mxfp4_converted, out, "--format", "gguf")
    assert r.exit_code == 0, r.output
    assert "requantization error fp8_e4m3_b128 -> q8_0" in r.stderr
    return out / "model.gguf"


def test_the_mxfp4_repack_is_lossless_and_means_what_gguf_reads():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (7, 48), dtype=torch.uint8, generator=g)  # 96 elements a row: 3 blocks
    scale = torch.randint(100, 140, (7, 3), dtype=torch.uint8, generator=g)
    rows = mxfp4_to_gguf(packed.numpy(), scale.numpy())
    assert rows.shape == (7, 3 * 17)
    back = gguf_to_mxfp4(rows)
    assert np.array_equal(back[0], packed.numpy()) and np.array_equal(back[1], scale.numpy())
    theirs = gguf.quants.dequantize(rows, Q.MXFP4)  # [7, 96]
    ours = mxfp4_dequantize(packed, scale).numpy()
    assert np.array_equal(theirs, ours)
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_to_gguf(packed.numpy()[:, :40], scale.numpy())


def _tensors(path: Path) -> dict[str, object]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _values(t) -> np.ndarray:
    """A GGUF tensor as fp32, in numpy order (the reverse of ggml's)."""
    shape = tuple(int(x) for x in reversed(t.shape))
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def test_every_tensor_has_llama_cpps_name_type_shape_and_dsfp4s_values(mxfp4_converted, exported):
    m = Manifest.read(mxfp4_converted)
    a, src = m.args, Source(mxfp4_converted, m)  # dsfp4's own dequantization of each stored tensor
    got = _tensors(exported)
    assert _values(got["token_embd.weight"]).tobytes() == src.dense("embed.weight").tobytes()  # BF16: exact
    assert got["token_embd.weight"].tensor_type == Q.BF16 and got["output.weight"].tensor_type == Q.BF16
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(a.n_layers):
        p = f"blk.{i}."
        for key, name in LAYER.items():
            ref = f"layers.{i}.{key}"
            if ref not in m.tensors:
                continue
            dense = src.dense(ref)
            if key == "attn.wkv_b":  # [H (N + V), C] -> k_b [H, C, N], v_b [H, V, C] in F16
                h, n = a.n_heads, a.qk_nope_head_dim
                w = dense.reshape(h, -1, a.kv_lora_rank)
                k_b, v_b = _values(got[p + name[0]]), _values(got[p + name[1]])
                assert got[p + name[0]].tensor_type == Q.F16 == got[p + name[1]].tensor_type
                np.testing.assert_allclose(k_b, w[:, :n].transpose(0, 2, 1), rtol=2**-10, atol=1e-6)
                np.testing.assert_allclose(v_b, w[:, n:], rtol=2**-10, atol=1e-6)
                names |= {p + name[0], p + name[1]}
                continue
            t, names = got[p + name], names | {p + name}
            if dense.ndim == 1 or key.endswith(("gate.weight", "gate.bias")):
                assert t.tensor_type == Q.F32 and np.array_equal(_values(t), dense)
            else:
                assert t.tensor_type == Q.Q8_0
                err = np.linalg.norm(_values(t) - dense) / np.linalg.norm(dense)
                assert err < 0.01, (ref, err)
        if i in m.experts:
            for e in (0, a.n_routed_experts - 1):
                w1, w3, w2 = m.record.dequantize(_raw(mxfp4_converted, m, i, e))
                for name, w in (("ffn_gate_exps", w1), ("ffn_up_exps", w3), ("ffn_down_exps", w2)):
                    t = got[f"{p}{name}.weight"]
                    assert t.tensor_type == Q.MXFP4 and np.array_equal(_values(t)[e], w.numpy()), (i, e, name)
            names |= {f"{p}{x}.weight" for x in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    assert set(got) == names  # nothing else, and the MTP layer left out
    fields = gguf.GGUFReader(exported).fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "deepseek2"
    assert int(fields["deepseek2.expert_count"].parts[-1][0]) == a.n_routed_experts
    assert int(fields["deepseek2.leading_dense_block_count"].parts[-1][0]) == a.n_dense_layers
    assert len(fields["tokenizer.ggml.tokens"].data) == a.vocab_size


def _raw(model: Path, m: Manifest, layer: int, e: int) -> bytes:
    entry = m.experts[layer]
    with open(model / entry.file, "rb") as f:
        f.seek(entry.offsets[e])
        return f.read(m.record.nbytes)


def test_an_interrupted_export_resumes_to_the_same_bytes(mxfp4_converted, exported, tmp_path, monkeypatch):
    out = tmp_path / "o"
    calls = {"n": 0}
    real = Source.stored

    def flaky(self, layer: int, e: int, which: str):
        calls["n"] += 1
        if calls["n"] == 5:  # inside the first expert matrix: the file is part written
            raise KeyboardInterrupt
        return real(self, layer, e, which)

    monkeypatch.setattr(Source, "stored", flaky)
    with pytest.raises(KeyboardInterrupt):
        from dsfp4.convert.export.writer import export_gguf

        export_gguf(mxfp4_converted, out, progress=False)
    done = json.loads((out / PROGRESS).read_text())
    assert done["tensors"] > 0 and (out / "model.gguf.partial").is_file() and not (out / "model.gguf").exists()
    monkeypatch.setattr(Source, "stored", real)
    r = run_cli("export", mxfp4_converted, out, "--format", "gguf", "-q")
    assert r.exit_code == 0, r.output
    assert (out / "model.gguf").read_bytes() == exported.read_bytes()
    assert json.loads((out / PROGRESS).read_text())["complete"]


def test_dry_run_and_bad_input(converted, mxfp4_converted, tmp_path):
    r = run_cli("export", mxfp4_converted, tmp_path / "d", "--format", "gguf", "--dry-run")
    assert r.exit_code == 0 and "MXFP4" in r.output and "model.gguf" in r.output and not (tmp_path / "d").exists()
    r = run_cli("export", converted, tmp_path / "n", "--format", "gguf")  # NVFP4 experts
    assert_one_line_error(r, "experts are nvfp4", "--format mxfp4", "--requantize")
    assert not (tmp_path / "n").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert_one_line_error(run_cli("export", mxfp4_converted, other, "--format", "gguf"), "holds something other")
    os.remove(other / "notes.txt")


def test_a_refusal_found_in_the_header_leaves_no_folder_behind(mxfp4_converted, tmp_path):
    """The tokenizer is checked while the header is made, before OUT is touched."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(mxfp4_converted, bare)
    (bare / "tokenizer.json").unlink()
    assert_one_line_error(run_cli("export", bare, tmp_path / "o", "--format", "gguf"), "tokenizer.json is missing")
    assert not (tmp_path / "o").exists()


def test_nvfp4_experts_requantized_on_request_hold_mxfp4_of_dsfp4s_values(converted, tmp_path):
    r = run_cli("export", converted, tmp_path / "o", "--format", "gguf", "--requantize")
    assert r.exit_code == 0, r.output
    assert "requantization error nvfp4 -> mxfp4 (experts)" in r.stderr
    m = Manifest.read(converted)
    got = _tensors(tmp_path / "o" / "model.gguf")
    layer = min(m.experts)
    for which, name in (("w1", "ffn_gate_exps"), ("w2", "ffn_down_exps")):
        w = m.record.matrix(_raw(converted, m, layer, 1), which)
        packed, scale = mxfp4_quantize(w)
        theirs = _values(got[f"blk.{layer}.{name}.weight"])[1]
        assert np.array_equal(theirs, mxfp4_dequantize(packed, scale).numpy())  # the MXFP4 nearest dsfp4's values
        assert np.linalg.norm(theirs - w.numpy()) / np.linalg.norm(w.numpy()) < 0.2
