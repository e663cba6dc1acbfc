"""`dsfp4 eval`: the windows' contract, the log-probabilities file, perplexity against transformers' on the same
weights, KL against a reference, and bad input as one-line errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.tools import logprobs_file
from dsfp4.tools.evaluate import _bucket_kl, scored_targets, windows
from dsfp4.tools.logprobs_file import LogProbs, decode, encode
from tests.fixtures.cli import assert_one_line_error, run_cli

TEXT = (
    "def forward(x):\n    return x * 2 + 1  # the model reads expert weights from disk\n"
    "hello world! how are you? the memory holds the hottest experts while one graphics card computes tokens.\n"
) * 6
CPU = ("--device", "cpu", "--dtype", "fp32", "-q")


@pytest.mark.parametrize("bos", [True, False])
@pytest.mark.parametrize("n_text", [1, 7, 8, 9, 23, 40])
@pytest.mark.parametrize("context", [2, 3, 8])
def test_windows_score_each_text_token_once_in_order_and_drop_the_tail(bos, n_text, context):
    body = context - bos
    for stride in range(1, context):
        wins = windows(n_text, context, stride, bos)
        assert [w.start for w in wins] == list(range(0, n_text - body + 1, stride))
        scored = [i for w in wins for i in range(w.first, w.end)]
        assert scored == sorted(set(scored))  # once each, in order
        if wins:
            first = 0 if bos else 1  # nothing predicts the text's first token without a BOS before it
            assert scored == list(range(first, wins[-1].end))
            assert all(w.end - w.start == body and w.first >= w.start + (not bos) for w in wins)
    assert windows(n_text, context, None, bos) == windows(n_text, context, context - 1, bos)


def test_window_arguments_out_of_range_are_errors():
    with pytest.raises(ConfigError, match=r"--stride 8: give 1 to 7 \(--context - 1\)"):
        windows(100, 8, 8, True)
    with pytest.raises(ConfigError, match="--stride 0"):
        windows(100, 8, 0, False)
    with pytest.raises(ConfigError, match="--context 1"):
        windows(100, 1, None, True)


def _logprobs(n: int, k: int, seed: int = 0) -> LogProbs:
    g = np.random.default_rng(seed)
    return LogProbs(
        g.integers(0, 1000, n, dtype=np.int32),
        -g.random(n, dtype=np.float32) * 9,
        g.integers(0, 1000, (n, k), dtype=np.int32),
        -g.random((n, k), dtype=np.float32) * 9,
    )


@pytest.mark.parametrize("n", [0, 1, 5, 1000])
@pytest.mark.parametrize("k", [1, 3, 32])
def test_the_logprobs_file_round_trips(n, k):
    lp = _logprobs(n, k, seed=n * 31 + k)
    head, back = decode(encode({"vocab_size": 1000, "context": 9, "note": "é"}, lp))
    assert head["vocab_size"] == 1000 and head["note"] == "é" and head["k"] == k and head["positions"] == n
    for name in ("targets", "target_logprob", "top_ids", "top_logprob"):
        a, b = getattr(lp, name), getattr(back, name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name


def test_a_damaged_logprobs_file_names_what_is_wrong(tmp_path):
    data = encode({}, _logprobs(50, 4))
    cases = {
        "not a dsfp4": b"PK\x03\x04" + data[4:],
        "truncated header": data[:9],
        "damaged data": data[:-7],
        "format version": data.replace(b'"format_version": 1', b'"format_version": 9'),
    }
    for needle, bad in cases.items():
        with pytest.raises(ValueError, match=needle):
            decode(bad)
    (tmp_path / "x.lp").write_bytes(cases["not a dsfp4"])
    with pytest.raises(ConfigError, match="x.lp: not a dsfp4"):
        logprobs_file.read(tmp_path / "x.lp")


def test_bucket_kl_is_the_full_kl_with_every_token_kept_and_a_lower_bound_with_fewer():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(3 * torch.randn(20, 50, generator=g), -1)
    q = torch.log_softmax(3 * torch.randn(20, 50, generator=g), -1)
    full = (p.exp() * (p - q)).sum(1).double()
    lp, ids = p.topk(50, dim=-1)
    assert torch.allclose(_bucket_kl(ids, lp, q), full, atol=1e-6)
    lp5, ids5 = p.topk(5, dim=-1)
    some = _bucket_kl(ids5, lp5, q)
    assert (some <= full + 1e-9).all() and (some >= 0).all() and some.sum() > 0
    assert torch.allclose(_bucket_kl(ids5, lp5, p), torch.zeros(20, dtype=torch.float64), atol=1e-9)


def _hf_perplexity(model_dir, context: int) -> tuple[float, int]:
    """exp(mean NLL) over the eval windows, from transformers in fp32 on the converted weights."""
    from tests.fixtures.reference import hf_model

    tok = ChatTokenizer(model_dir)
    ids = tok.encode(TEXT, special=False)
    bos = tok.add_bos and tok.bos_id is not None
    ref, nll, n = hf_model(model_dir), 0.0, 0
    for w in windows(len(ids), context, None, bos):
        tokens = [tok.bos_id] * bos + ids[w.start : w.end]
        with torch.no_grad():
            logp = torch.log_softmax(ref(torch.tensor([tokens])).logits[0].double(), -1)  # [T, V]
        for i in range(w.first, w.end):
            nll -= float(logp[i - w.start + bos - 1, ids[i]])
            n += 1
    return math.exp(nll / n), n


def test_perplexity_equals_transformers_on_the_same_weights_and_a_self_reference_gives_kl_zero(converted, tmp_path):
    want, n = _hf_perplexity(converted, 24)
    ref = tmp_path / "ref.lp"
    r = run_cli("eval", converted, "--text", _text(tmp_path), "--context", 24, "--save-logits", ref, "--json", *CPU)
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["tokens"] == n and abs(got["perplexity"] - want) / want < 1e-4, (got, want)
    again = run_cli("eval", converted, "--text", _text(tmp_path), "--context", 24, "--reference", ref, "--json", *CPU)
    assert again.exit_code == 0, again.output
    cmp = json.loads(again.stdout)
    assert cmp["kl_mean"] == 0.0 and cmp["kl_p99"] == 0.0 and cmp["top1_agreement"] == 1.0
    assert cmp["perplexity_ratio"] == pytest.approx(1.0, abs=1e-12)
    header, lp = logprobs_file.read(ref)
    assert header["context"] == 24 and len(lp.targets) == n and lp.k == 32
    tok = ChatTokenizer(converted)
    ids = tok.encode(TEXT, special=False)
    assert np.array_equal(lp.targets, scored_targets(ids, windows(len(ids), 24, None, tok.add_bos)))


def test_a_lossy_run_against_the_exact_reference_shows_a_positive_kl(converted, tmp_path):
    """bf16 compute against the fp32 reference: a small, positive divergence, as a lossy option would show."""
    ref = tmp_path / "ref.lp"
    text = _text(tmp_path)
    assert run_cli("eval", converted, "--text", text, "--context", 16, "--save-logits", ref, *CPU).exit_code == 0
    bf16 = ("--device", "cpu", "--dtype", "bf16", "-q")
    r = run_cli("eval", converted, "--text", text, "--context", 16, "--reference", ref, "--json", *bf16)
    assert r.exit_code == 0, r.output
    cmp = json.loads(r.stdout)
    assert 0 < cmp["kl_mean"] < 0.1 and cmp["kl_p99"] >= cmp["kl_mean"] and 0.5 < cmp["top1_agreement"] <= 1


def _text(tmp_path, text: str = TEXT):
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    return path


def test_bad_input_is_a_one_line_error(converted, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert_one_line_error(run_cli("eval", converted, "--text", empty, *CPU), "empty.txt", "empty")
    short = tmp_path / "short.txt"
    short.write_text("hello world")
    assert_one_line_error(run_cli("eval", converted, "--text", short, *CPU), "short.txt", "shorter than one window")
    text = _text(tmp_path)
    other = tmp_path / "other.lp"
    logprobs_file.write(other, {"vocab_size": 7, "context": 24, "stride": 23, "bos": True}, _logprobs(3, 2))
    r = run_cli("eval", converted, "--text", text, "--context", 24, "--reference", other, *CPU)
    assert_one_line_error(r, "other.lp", "vocabulary of 7 tokens")
    ref = tmp_path / "ref.lp"
    assert run_cli("eval", converted, "--text", text, "--context", 24, "--save-logits", ref, *CPU).exit_code == 0
    r = run_cli("eval", converted, "--text", text, "--context", 20, "--reference", ref, *CPU)
    assert_one_line_error(r, "ref.lp", "context 24", "--context")
    shifted = _text(tmp_path, "x" + TEXT)
    r = run_cli("eval", converted, "--text", shifted, "--context", 24, "--reference", ref, *CPU)
    assert_one_line_error(r, "ref.lp", "other tokens")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    assert_one_line_error(run_cli("eval", converted, "--text", binary, *CPU), "bin.txt", "UTF-8")
    r = run_cli("eval", converted, "--text", text, "--context", 24, "--stride", 99, *CPU)
    assert_one_line_error(r, "--stride 99")
    r = run_cli("eval", converted, "--text", text, "--context", 10**6, *CPU)
    assert_one_line_error(r, "--context 1000000", "at most")


@pytest.mark.gpu
def test_on_cuda_eval_runs_the_kernels_and_stays_close_to_the_cpu_reference(converted, tmp_path):
    ref = tmp_path / "ref.lp"
    text = _text(tmp_path)
    assert run_cli("eval", converted, "--text", text, "--context", 24, "--save-logits", ref, *CPU).exit_code == 0
    r = run_cli(
        "eval", converted, "--text", text, "--context", 24, "--reference", ref, "--json", "-q", "--device", "cuda"
    )
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    assert got["kl_mean"] < 0.01 and got["top1_agreement"] > 0.9 and abs(got["perplexity_ratio"] - 1) < 0.01
