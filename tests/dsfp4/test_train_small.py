"""scripts/train_small.py on a CPU at the tiny size: it trains (the loss falls), writes the release's layout, which
convert, eval, run and the reference scripts take as they take DeepSeek's; the MTP layer and the routers' balance
are trained too."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.fixtures.cli import run_cli

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "src"
    _script("train_small").main(
        [str(out), "--size", "tiny", "--files", "40", "--steps", "40", "--batch", "8", "--seq", "64", "--device", "cpu"]
    )
    return out


# the held-out text's first characters the quality checks read: about 1,500 tokens of its 45k, enough for their
# verdicts
HELDOUT_CHARS = 4000


@pytest.fixture(scope="module")
def heldout(trained, tmp_path_factory) -> Path:
    part = tmp_path_factory.mktemp("heldout") / "heldout.txt"
    part.write_text((trained / "heldout.txt").read_text()[:HELDOUT_CHARS])
    return part


def test_training_lowers_the_loss_and_balances_the_routers(trained):
    t = json.loads((trained / "training.json").read_text())
    first, last = t["curve"][0], t["curve"][-1]
    assert t["steps"] == 40 and last["step"] == 40
    assert last["train_loss"] < first["train_loss"] - 0.5 and last["heldout_loss"] < first["heldout_loss"] - 0.5
    assert last["train_mtp_loss"] < first["train_mtp_loss"] - 0.5
    assert (trained / "heldout.txt").read_text().strip()
    index = json.loads((trained / "model.safetensors.index.json").read_text())["weight_map"]
    n = json.loads((trained / "config.json").read_text())["num_hidden_layers"]
    bias = f"model.layers.{n - 1}.mlp.gate.e_score_correction_bias"
    with safe_open(trained / index[bias], "pt") as f:
        assert f.get_tensor(bias).abs().max() > 0  # the balance moved it
    assert f"model.layers.{n}.eh_proj.weight" in index and f"model.layers.{n}.mlp.experts.0.up_proj.weight" in index


def test_the_trained_release_converts_evaluates_and_runs_with_its_mtp(trained, heldout, tmp_path):
    model = tmp_path / "model"
    assert run_cli("convert", "--fp4", trained, model, "-q").exit_code == 0
    ref = tmp_path / "ref.lp"
    text = heldout
    _script("reference_logits").main([str(trained), "--text", str(text), "--out", str(ref), "--context", "32"])
    r = run_cli("eval", model, "--text", text, "--context", 32, "--reference", ref, "--json", "-q", "--device", "cpu")
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert 0 < got["kl_mean"] < 0.05 and got["top1_agreement"] > 0.8 and abs(got["perplexity_ratio"] - 1) < 0.05
    assert got["perplexity"] < 512  # below the vocabulary's size: it learned something
    r = run_cli("run", model, "--prompt", "def", "--max-tokens", 8, "--temperature", 0, "--mtp", "--device", "cpu")
    assert r.exit_code == 0, r.output


def test_the_trained_release_as_an_nvfp4_export_converts_close_to_the_original(trained, heldout, tmp_path):
    nv = tmp_path / "nvfp4"
    _script("release_variant").main([str(trained), str(nv), "--variant", "nvfp4"])
    assert (nv / "hf_quant_config.json").is_file()
    assert run_cli("convert", "--fp4", nv, tmp_path / "model", "-q").exit_code == 0
    ref = tmp_path / "ref.lp"
    text = heldout
    _script("reference_logits").main([str(trained), "--text", str(text), "--out", str(ref), "--context", "32"])
    r = run_cli(
        "eval",
        tmp_path / "model",
        "--text",
        text,
        "--context",
        32,
        "--reference",
        ref,
        "--json",
        "-q",
        "--device",
        "cpu",
    )
    assert r.exit_code == 0, r.output
    assert 0 < json.loads(r.stdout)["kl_mean"] < 0.05


def test_the_docs_corpus_reads_prose_beside_the_packages_code_and_leaves_data_files_out(tmp_path, monkeypatch):
    ts = _script("train_small")
    site, pkg = tmp_path / "site", tmp_path / "site" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (site / "README.md").write_text("# prose\n")
    (site / "pkg-1.0.dist-info").mkdir()
    (site / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\n")
    (site / "words.txt").write_text("w\n" * (ts.PROSE_MAX_BYTES // 2 + 1))  # a word list, not prose
    monkeypatch.setattr(ts, "corpus_roots", lambda kind: {"site": [site], "packages": [pkg]}.get(kind, []))
    docs = {p.relative_to(site).as_posix() for _, p in ts.corpus_files("docs")}
    assert docs == {"README.md", "pkg-1.0.dist-info/METADATA", "pkg/a.py"}
    assert {p.name for _, p in ts.corpus_files("code")} == {"a.py"}  # code: the packages' (and stdlib's) sources
