"""scripts/bench_model.py writes a model that verify, the manifest reader and the runtime take as converted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsfp4 import Engine
from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.quant import dequantize
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.safetensors_file import read_header
from dsfp4.layout.verify import verify
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.runtime.models.load import load_model
from dsfp4.synthetic.bench_model import model_args, write_bench_model
from dsfp4.synthetic.hf_v3 import word_corpus, write_tokenizer
from dsfp4.synthetic.hf_v4 import random_v4_values, write_v4_checkpoint

BENCH_MODEL = Path(__file__).resolve().parents[2] / "scripts" / "bench_model.py"

SMALL = dict(
    hidden_size=256,
    moe_intermediate_size=128,
    intermediate_size=384,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    num_attention_heads=4,
    vocab_size=512,
    q_lora_rank=192,  # ragged: not a multiple of the 128-row FP8 block
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
)


def _forward(out) -> torch.Tensor:
    model = load_model(out, torch.device("cpu"), torch.float32, max_len=64)
    tokens = torch.tensor([[0, 17, 300, 5, 511, 42]])
    try:
        with torch.no_grad():
            logits, _ = model(tokens)
    finally:
        model.experts.close()
    return logits


@pytest.mark.parametrize("backbone", ["fp8_e4m3_b128", "nvfp4"])
def test_bench_model_verifies_loads_and_runs(tmp_path, backbone):
    out = tmp_path / "model"
    m = write_bench_model(out, n_layers=3, n_dense=1, dims=SMALL, backbone=backbone, with_tokenizer=True)
    report = verify(out)
    assert report.n_records == 2 * 16
    assert m.to_json() == Manifest.read(out).to_json()
    a = m.args
    assert (a.dim, a.moe_inter_dim, a.n_routed_experts, a.n_activated_experts, a.n_mtp_layers) == (256, 128, 16, 4, 0)
    router = (a.rope_type, a.rope_factor, a.score_func, a.topk_method, a.route_scale, a.norm_topk_prob)
    assert router == ("yarn", 40, "sigmoid", "noaux_tc", 2.5, True)
    mode = {"fp8_e4m3_b128": "fp8", "nvfp4": "fp4"}[backbone]
    assert sorted(m.experts) == [1, 2]
    assert m.options == {"format": "nvfp4", "backbone": mode, "head": "bf16", "mtp": False}
    for layer in m.experts.values():
        assert len(set(layer.sha256)) == 16  # every record differs
    # sane values: records decode to finite weights of std ~ 1/sqrt(fan_in), padding zero
    raw = (out / m.experts[1].file).read_bytes()
    rec = raw[m.experts[1].offsets[5] : m.experts[1].offsets[5] + m.record.nbytes]
    w1, w3, w2 = m.record.dequantize(rec)
    for w, fan_in in ((w1, 256), (w3, 256), (w2, 128)):
        assert torch.isfinite(w).all() and 0.7 < w.std().item() * math.sqrt(fan_in) < 1.3
    last = m.record.parts[-1]
    assert not any(rec[last.offset + last.nbytes :])
    logits = _forward(out)
    assert logits.shape == (1, 6, 512) and torch.isfinite(logits).all() and logits.std() > 0
    tok = ChatTokenizer(out, a.eos_token_ids)
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_bench_model_backbone_values(tmp_path):
    out = tmp_path / "model"
    m = write_bench_model(out, n_layers=2, n_dense=1, seed=3, dims=SMALL)
    t = m.tensors["layers.0.attn.wq_b"]
    assert t.format == "fp8_e4m3_b128" and t.file == "backbone/layer-000.safetensors"
    with safe_open(str(out / t.file), "pt") as f:
        w = dequantize(t.format, [f.get_tensor(t.tensors[c]) for c in ("weight", "scale")])
        norm = f.get_tensor("layers.0.attn_norm.weight")
    assert w.shape == (4 * 64, 192) and 0.8 < w.std().item() * math.sqrt(192) < 1.2
    assert norm.dtype == torch.bfloat16 and bool((norm == 1).all())
    bias = m.tensors["layers.1.ffn.gate.bias"]
    assert bias.format == "f32" and m.tensors["layers.1.ffn.gate.weight"].format == "bf16"
    assert "tokenizer.json" not in m.files and "config.json" in m.files


def bench_model_cli(*args: str) -> str:
    """scripts/bench_model.py run as a user runs it: its stdout."""
    return subprocess.run([sys.executable, str(BENCH_MODEL), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_bench_model_refuses_a_used_folder_and_cli_prints(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("")
    with pytest.raises(FileExistsError):
        write_bench_model(tmp_path / "x", dims=SMALL)
    dims = [f"{k}={v}" for k, v in SMALL.items()]
    assert "2 layers (1 MoE, 16 experts each)" in bench_model_cli(
        str(tmp_path / "cli"), "--layers", "2", "--dense", "1", "--dims", *dims
    )
    verify(tmp_path / "cli")
    dims = [f"{k}={v}" for k, v in SMALL_V4.items()]
    assert "2 layers (2 MoE, 16 experts each)" in bench_model_cli(
        str(tmp_path / "v4"), "--family", "v4", "--layers", "2", "--dims", *dims
    )
    assert verify(tmp_path / "v4").n_records == 2 * 16


def test_bench_model_with_an_mtp_layer_drafts(tmp_path):
    out = tmp_path / "mtp"
    m = write_bench_model(out, n_layers=2, n_dense=1, dims=SMALL, with_tokenizer=True, mtp=True)
    assert m.args.n_mtp_layers == 1 and sorted(m.experts) == [1, 2] and verify(out).n_records == 2 * 16
    with Engine(out, device="cpu", max_context=64, temperature=0) as plain:
        want = plain.generate([5, 17, 300], max_tokens=8).token_ids
    with Engine(out, device="cpu", max_context=64, temperature=0, mtp=True) as engine:
        engine.speculator.adaptive = False
        g = engine.generate([5, 17, 300], max_tokens=8)
    assert g.token_ids == want and g.stats.drafted > 0


# V4-Flash at small width: the real layer schedule (sliding, sliding, CSA, HCA; hash layers 0-2), a ragged q_lora
SMALL_V4 = dict(
    hidden_size=256,
    moe_intermediate_size=128,
    n_routed_experts=16,
    num_experts_per_tok=4,
    num_attention_heads=8,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=192,
    o_groups=2,
    o_lora_rank=64,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=8,
    vocab_size=512,
    sliding_window=16,
)


@pytest.fixture(scope="module")
def v4_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_v4") / "model"
    write_bench_model(out, n_layers=4, dims=SMALL_V4, with_tokenizer=True, mtp=True, family="v4")
    return out


def test_full_width_v4_config_and_record():
    cfg, a = model_args(4, 0, mtp=True, family="v4")
    assert cfg["compress_ratios"] == [0, 0, 4, 128, 0]  # the real model's first 4 layers, then the MTP entry
    assert a.layer_kinds == ("sliding", "sliding", "csa", "hca", "sliding") and a.n_mtp_layers == 1
    assert (a.dim, a.head_dim, a.n_routed_experts, a.n_activated_experts, a.moe_inter_dim) == (4096, 512, 256, 6, 2048)
    assert (a.n_hash_layers, a.hc_mult, a.swiglu_limit, a.index_topk, a.window_size) == (3, 4, 10.0, 512, 128)
    assert (a.score_func, a.route_scale, a.compress_rope_theta, a.rope_factor) == ("sqrtsoftplus", 1.5, 160000, 16)
    assert model_args(43, 0, family="v4")[1].layer_kinds[40:] == ("csa", "hca", "csa")  # layer 42 is CSA
    assert RecordLayout.for_expert("mxfp4", a.dim, a.moe_inter_dim).nbytes == 13_369_344
    with pytest.raises(ValueError, match="no dense layers"):
        model_args(4, 1, family="v4")


def test_bench_v4_writes_what_the_converter_writes(v4_bench, tmp_path):
    """The same tensors (names, formats, shapes, files, order in each file), records and args as converting an
    official V4 checkpoint of the same config.json."""
    cfg = json.loads((v4_bench / "config.json").read_text())
    hf = write_v4_checkpoint(tmp_path / "hf", cfg, random_v4_values(cfg, 0))
    convert(hf, tmp_path / "c", ConvertOptions(workers=1), progress=False)
    bench, conv = Manifest.read(v4_bench), Manifest.read(tmp_path / "c")
    assert bench.args == conv.args and bench.record == conv.record and bench.options == conv.options
    assert bench.tensors == conv.tensors and sorted(bench.experts) == sorted(conv.experts) == [0, 1, 2, 3, 4]
    for f in {t.file for t in bench.tensors.values()}:
        layout = [
            [(n, i.dtype, i.shape, i.offset) for n, i in read_header(d / f).items()] for d in (v4_bench, tmp_path / "c")
        ]
        assert layout[0] == layout[1], f


def test_bench_v4_verifies_and_generates_finite_logits(v4_bench):
    m = Manifest.read(v4_bench)
    assert verify(v4_bench).n_records == 5 * 16 and m.record.format == "mxfp4"
    with safe_open(str(v4_bench / m.tensors["layers.2.ffn.gate.tid2eid"].file), "pt") as f:
        table = f.get_tensor("layers.2.ffn.gate.tid2eid")  # [V, k]: k distinct valid experts per token
    assert table.shape == (512, 4) and table.min() >= 0 and table.max() < 16
    assert bool((table.sort(dim=1).values.diff(dim=1) > 0).all()) and len(table.unique()) == 16
    w1, _, w2 = m.record.dequantize(
        (v4_bench / m.experts[3].file).read_bytes()[m.experts[3].offsets[7] :][: m.record.nbytes]
    )
    for w, fan_in in ((w1, 256), (w2, 128)):
        assert torch.isfinite(w).all() and 0.7 < w.std().item() * math.sqrt(fan_in) < 1.3
    prompt = torch.randint(0, 512, (140,), generator=torch.Generator().manual_seed(0)).tolist()
    with Engine(v4_bench, device="cpu", max_context=192, temperature=0) as engine:
        logits = engine.logits(prompt)  # past 128 tokens: the HCA layer has an entry, CSA's indexer picks
        g = engine.generate(prompt, max_tokens=4)
    assert logits.shape == (140, 512) and torch.isfinite(logits).all() and logits.std() > 0.1
    assert len(g.token_ids) == 4 and g.token_ids[0] == int(logits[-1].argmax())


def test_a_bench_tokenizer_decodes_nearly_every_id_to_text(tmp_path):
    """Trained on word_corpus, a bench model's tokenizer fills its vocabulary with words: whatever id a random model
    emits decodes to text a client sees (all but the byte alphabet's lone non-ASCII bytes)."""
    from tokenizers import Tokenizer

    write_tokenizer(tmp_path, 8192, corpus=word_corpus(8192))
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() > 8000
    visible = sum(bool(tok.decode([i]).strip()) for i in range(tok.get_vocab_size()))
    assert visible / tok.get_vocab_size() > 0.97
