"""profile-hot: the layer-wise pass counts exactly what ordinary generation routes and reads each record
once; calibration input; hot.json's format, merging and refusal; routing traces; the report."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dsfp4.errors import ConfigError, ManifestError
from dsfp4.layout.hot_profile import HOT_NAME, HotProfile
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.routing_trace import RoutingTrace, read_trace, write_trace
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.runtime.models.load import plan_run
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.profile.calibration import BUILTIN_FILES, BUILTIN_SOURCE, builtin_entries, calibration
from dsfp4.runtime.profile.hot_report import coverage, gini, static_hit_rates, write_plot
from dsfp4.runtime.profile.profiler import profile_model
from tests.fixtures.cli import assert_one_line_error, run_cli

CPU = torch.device("cpu")
SEQ, CHUNK, TOKENS = 24, 8, 100  # sequences prefilled in three chunks, the last one short
LINES = [f"Line {i}: the tiered store reads record {i * 7} of layer {i % 3}." for i in range(30)]


@pytest.fixture
def model(converted, tmp_path) -> Path:
    return Path(shutil.copytree(converted, tmp_path / "model"))


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n\n".join(LINES) + "\n")
    return path


def _plan(model_dir: Path, gpu_slots: int, ram_slots: int):
    options = RunOptions(device="cpu", max_context=SEQ, prefill_chunk=CHUNK)
    plan = plan_run(Manifest.read(model_dir), CPU, torch.float32, SEQ, options, False)
    return dataclasses.replace(plan, gpu_slots=gpu_slots, ram_slots=ram_slots, staging=min(4, ram_slots))


def _generation_counts(model_dir: Path, sequences: list[list[int]], n_experts: int = 8) -> dict[int, tuple[int, ...]]:
    """Each sequence through ordinary generation (prefill in CHUNK-token passes, as `dsfp4 run`), its
    routing counted by forward hooks on the routers (prefetch off: it would call them too)."""
    engine = Engine(model_dir, device="cpu", max_context=SEQ + 1, prefill_chunk=CHUNK, prefetch=False)
    counts: dict[int, np.ndarray] = {}

    def hook(layer: int):
        def count(module, inputs, output):
            counts[layer] = counts.get(layer, 0) + np.bincount(output[1].flatten().numpy(), minlength=n_experts)

        return count

    handles = [b.ffn.gate.register_forward_hook(hook(i)) for i, b in enumerate(engine.model.layers) if b.moe]
    for seq in sequences:
        engine.reset()
        engine.generate(seq, max_tokens=1, temperature=0)  # prefill; the sampled token is not fed back
    for h in handles:
        h.remove()
    engine.close()
    return {layer: tuple(int(x) for x in c) for layer, c in counts.items()}


@pytest.mark.slow
def test_layerwise_counts_equal_ordinary_generation_and_each_record_is_read_once(model, prompts):
    sequences = calibration(ChatTokenizer(model), prompts, False, TOKENS, SEQ).sequences
    assert [len(s) for s in sequences] == [24, 24, 24, 24, 4]
    want = _generation_counts(model, sequences)
    options = RunOptions(device="cpu", max_context=SEQ, prefill_chunk=CHUNK)
    n_layers = len(want)
    for ram_slots in (8, 12, 16):  # one layer in RAM; a part of the next, or all of it, read behind it
        run = profile_model(model, options, prompts, False, TOKENS, trace=True, plan=_plan(model, 3, ram_slots))
        assert run.profile.counts == want and run.profile.tokens == TOKENS
        assert run.counters["ssd_reads"] == n_layers * 8 and run.counters["ssd_misses"] == 0  # each record once
        assert not run.notes
        t = run.trace
        assert t.ids.shape == (TOKENS, n_layers, 2) and list(t.layers) == sorted(want)
        assert list(t.tokens) == [x for s in sequences for x in s]
        for i, layer in enumerate(t.layers):
            assert tuple(np.bincount(t.ids[:, i].ravel(), minlength=8)) == want[layer]
            sums = np.bincount(t.ids[:, i].ravel(), weights=t.weights[:, i].ravel(), minlength=8)
            np.testing.assert_allclose(run.profile.weights[int(layer)], sums, rtol=1e-5)
    small = profile_model(model, options, prompts, False, TOKENS, plan=_plan(model, 3, 5))  # less than a layer
    assert small.profile.counts == want and "read from the SSD more than once" in small.notes[0]


def test_deepseek_v4_layerwise_counts_equal_ordinary_generation(v4_converted, prompts):
    """V4's blocks take the mHC streams and the tokens (hash layers route by them); the layer-by-layer pass
    gives the counts of ordinary generation, hash and scored layers alike."""
    m = Manifest.read(v4_converted)
    n = m.args.n_routed_experts
    sequences = calibration(ChatTokenizer(v4_converted), prompts, False, TOKENS, SEQ).sequences
    want = _generation_counts(v4_converted, sequences, n)
    assert len(want) == m.args.n_layers and any(m.args.is_hash_layer(layer) for layer in want)
    options = RunOptions(device="cpu", max_context=SEQ, prefill_chunk=CHUNK)
    run = profile_model(v4_converted, options, prompts, False, TOKENS, plan=_plan(v4_converted, 3, n))
    assert run.profile.counts == want and run.profile.tokens == TOKENS


def test_builtin_calibration_is_small_mixed_and_fills_the_sequences(converted):
    folder = Path(sys.modules["dsfp4"].__file__).parent / "calibration"
    assert sum((folder / name).stat().st_size for name in BUILTIN_FILES) < 400_000
    entries = builtin_entries()
    chats = [e for e in entries if isinstance(e, list)]
    assert len(chats) >= 20 and len(entries) - len(chats) >= 80
    assert all(m["role"] in ("system", "user", "assistant") for c in chats for m in c)
    assert {type(e) for e in entries[:4]} == {str, list}  # files interleaved: a few entries see every kind
    calib = calibration(ChatTokenizer(converted), None, False, 500, 64)
    assert calib.tokens == 500 and calib.source == BUILTIN_SOURCE
    assert [len(s) for s in calib.sequences] == [64] * 7 + [52]


def test_prompt_files_plain_lines_and_chat_json_lines(converted, tmp_path):
    tok = ChatTokenizer(converted)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": chat}) + "\n\n" + json.dumps({"text": "plain"}) + "\n" + json.dumps(chat))
    calib = calibration(tok, path, True, 10_000, 10_000)
    rendered = tok.encode_chat(chat, add_generation_prompt=False)
    assert calib.sequences == [rendered + tok.encode("plain") + rendered]
    assert "chat lines" in calib.source and calib.available == calib.tokens
    bad = {
        "notjson.jsonl": '{"messages": []}\n{"messages": [{"role": "user", "content": "x"}]}\nnot json\n',
        "role.jsonl": json.dumps({"messages": [{"role": "robot", "content": "x"}]}),
        "empty.txt": "\n \n",
    }
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=name):
            calibration(tok, tmp_path / name, name.endswith(".jsonl"), 100, 10)
    with pytest.raises(ConfigError, match="notjson.jsonl:1"):  # an empty conversation is no conversation
        calibration(tok, tmp_path / "notjson.jsonl", True, 100, 10)
    with pytest.raises(ConfigError, match="--chat-format describes a --prompts file"):
        calibration(tok, None, True, 100, 10)


def test_hot_profile_round_trip_merge_and_refusal(tmp_path):
    a = HotProfile("c" * 64, 10, {1: (3, 0, 5, 2), 2: (1, 1, 0, 8)}, {1: (0.5, 0.0, 1.25, 0.75)}, ("a.txt",))
    a.write(tmp_path / "a.json")
    assert HotProfile.read(tmp_path / "a.json") == a
    assert json.loads((tmp_path / "a.json").read_text())["layers"]["1"]["order"] == [2, 0, 3, 1]
    assert a.order(2) == [3, 0, 1, 2] and a.ranked()[:3] == [(2, 3), (1, 2), (1, 0)]
    both = a.merge(a, "a.json")
    assert both.tokens == 20 and both.counts[1] == (6, 0, 10, 4) and both.weights == {1: (1.0, 0.0, 2.5, 1.5)}
    assert both.sources == ("a.txt", "a.txt")
    other = dataclasses.replace(a, conversion="d" * 64)
    with pytest.raises(ManifestError, match="b.json was measured on another model or conversion"):
        a.merge(other, "b.json")
    with pytest.raises(ManifestError, match="layers or experts differ"):
        a.merge(dataclasses.replace(a, counts={1: (1, 2, 3, 4)}), "c.json")
    for name, text in {"v0.json": '{"format": "dsfp4-hot-0"}', "neg.json": "", "junk.json": "{"}.items():
        if name == "neg.json":
            text = a.to_json().decode().replace('"counts": [3,', '"counts": [-3,')
        (tmp_path / name).write_text(text)
        with pytest.raises(ManifestError, match=name):
            HotProfile.read(tmp_path / name)


def test_trace_files_npy_and_npz(tmp_path):
    ids = np.arange(24).reshape(2, 3, 4) % 8
    full = RoutingTrace(ids, np.ones((2, 3, 4), np.float32), np.array([1, 2, 3]), np.array([5, 6]))
    write_trace(tmp_path / "t.npz", full)
    back = read_trace(tmp_path / "t.npz")
    assert (back.ids == ids).all() and (back.weights == 1).all() and list(back.tokens) == [5, 6]
    write_trace(tmp_path / "t.npy", full)
    only = read_trace(tmp_path / "t.npy")
    assert (only.ids == ids).all() and only.weights is None
    np.savez(tmp_path / "noids.npz", weights=np.ones(3))
    np.savez(tmp_path / "badw.npz", ids=ids, weights=np.ones((2, 3)))
    for name, needle in (("noids.npz", "needs an 'ids' array"), ("badw.npz", "'weights' has shape")):
        with pytest.raises(ConfigError, match=needle):
            read_trace(tmp_path / name)
    with pytest.raises(ConfigError, match="t.txt: a routing trace is written as .npy"):
        write_trace(tmp_path / "t.txt", full)


def test_report_numbers():
    assert gini([5, 5, 5, 5]) == 0 and gini([0, 0, 0, 12]) == pytest.approx(0.75)
    assert list(coverage([1, 3, 0, 4])) == [0.5, 0.875, 1.0, 1.0]
    p = HotProfile("c", 4, {1: (4, 0, 2, 2), 2: (1, 1, 5, 1)})
    assert static_hit_rates(p, 1, 2) == (5 / 16, 11 / 16)


def _profile_cli(model: Path, prompts: Path, *more):
    return run_cli(
        "profile-hot",
        model,
        "--device",
        "cpu",
        "--prompts",
        prompts,
        "--tokens",
        60,
        "--max-context",
        SEQ,
        "--prefill-chunk",
        CHUNK,
        "-q",
        *more,
    )


def test_cli_profiles_merges_reports_and_the_run_warm_starts(model, prompts, tmp_path, monkeypatch):
    r = _profile_cli(model, prompts, "--trace", tmp_path / "t.npy")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(model / HOT_NAME) and "16 expert records" in r.stderr
    assert read_trace(tmp_path / "t.npy").ids.shape == (60, 2, 2)
    with Engine(model, device="cpu", max_context=64) as engine:
        assert engine.model.experts.warm_records == 16
        stats = engine.generate("hi", max_tokens=2).stats  # each generation's stats say how the engine started
        assert stats.warm_records == 16 and stats.warm_s > 0 and "warm start" in stats.table()
        assert stats.to_dict()["warm_records"] == 16
    r = run_cli(
        "profile-hot",
        model,
        "--no-measure",
        "--merge",
        model / HOT_NAME,
        "--merge",
        model / HOT_NAME,
        "-o",
        tmp_path / "two.json",
        "--report",
        "--device",
        "cpu",
    )
    assert r.exit_code == 0, r.output
    assert HotProfile.read(tmp_path / "two.json").tokens == 120
    assert "top 10%" in r.stdout and "static hot set" in r.stdout and (tmp_path / "two.png").stat().st_size > 1000
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "matplotlib is not installed" in write_plot(HotProfile.read(tmp_path / "two.json"), tmp_path / "x.png")


def test_cli_refuses_foreign_profiles_and_pointless_flags(model, prompts, tmp_path):
    foreign = tmp_path / "foreign.json"
    HotProfile("0" * 64, 5, {1: (1,) * 8, 2: (1,) * 8}).write(foreign)
    assert_one_line_error(_profile_cli(model, prompts, "--merge", foreign), "foreign.json", "another model")
    assert not (model / HOT_NAME).exists()  # refused before running
    shutil.copy(foreign, model / HOT_NAME)
    r = run_cli("run", model, "--prompt", "hi", "--device", "cpu")
    assert_one_line_error(r, "hot.json was measured on another model or conversion")
    (model / HOT_NAME).unlink()
    assert_one_line_error(run_cli("profile-hot", model, "--no-measure"), "hot.json not found")
    assert_one_line_error(_profile_cli(model, prompts, "--trace", tmp_path / "t.csv"), "t.csv", ".npy")
    assert_one_line_error(_profile_cli(model, prompts, "--trace", tmp_path / "no" / "t.npz"), "no/t.npz", "folder")
    assert_one_line_error(_profile_cli(model, prompts, "-o", tmp_path / "no" / "h.json"), "no/h.json", "folder")
    r = run_cli("run", model, "--prompt", "hi", "--device", "cpu", "--record-trace", tmp_path / "no" / "t.npz")
    assert_one_line_error(r, "no/t.npz", "does not exist")
    r = run_cli("profile-hot", model, "--no-measure", "--tokens", 5)
    assert r.exit_code == 2 and "--tokens would do nothing" in r.stderr


def test_run_records_the_trace_of_every_token_it_computes(model, tmp_path):
    path = tmp_path / "run.npz"
    r = run_cli(
        "run",
        model,
        "--prompt",
        "hello",
        "--device",
        "cpu",
        "--temperature",
        0,
        "--max-tokens",
        5,
        "--record-trace",
        path,
    )
    assert r.exit_code == 0, r.output
    t = read_trace(path)
    prompt = ChatTokenizer(model).encode_prompt("hello")
    assert list(t.tokens[: len(prompt)]) == prompt and len(t.tokens) == len(prompt) + 4  # the 5th is never fed
    assert t.ids.shape == (len(t.tokens), 2, 2) and t.weights.shape == t.ids.shape
    assert f"routing trace of {len(t.tokens)} tokens" in r.stderr


def test_an_interrupted_forward_leaves_no_half_recorded_tokens(model, tmp_path, monkeypatch):
    engine = Engine(model, device="cpu", max_context=64, record_trace=tmp_path / "t.npz")
    ids = engine.encode("hello")
    last = engine.model.layers[-1]
    real = type(last).forward

    def stop(self, *args):  # the last block fails: every MoE layer before it has routed this pass
        raise KeyboardInterrupt

    monkeypatch.setattr(last, "forward", stop.__get__(last))
    with pytest.raises(KeyboardInterrupt):
        engine.generate(ids, max_tokens=3, temperature=0)
    monkeypatch.setattr(last, "forward", real.__get__(last))
    g = engine.generate(ids, max_tokens=3, temperature=0)
    engine.close()
    t = read_trace(tmp_path / "t.npz")
    assert list(t.tokens) == ids + g.token_ids[:-1] and t.ids.shape[0] == len(t.tokens)


def test_a_profile_that_does_not_fit_the_model_is_refused(model):
    manifest = Manifest.read(model)
    for counts in ({1: (1,) * 4, 2: (1,) * 8}, {1: (1,) * 8, 7: (1,) * 8}):  # too few experts; no such layer
        (model / HOT_NAME).write_bytes(HotProfile(manifest.conversion_sha256(), 1, counts).to_json())
        with pytest.raises(ManifestError, match="hot.json: layer . is not a MoE layer of 8 experts"):
            Engine(model, device="cpu", max_context=64)


def test_a_folder_that_cannot_be_written_is_refused_before_measuring_and_a_failed_write_keeps_the_profile(
    model, prompts, tmp_path, monkeypatch
):
    import os as os_module

    from dsfp4.layout import atomic

    real_access = os_module.access
    read_only = lambda p, mode, **kw: not (Path(p) == model and mode & os_module.W_OK) and real_access(p, mode, **kw)  # noqa: E731
    monkeypatch.setattr(atomic.os, "access", read_only)
    r = _profile_cli(model, prompts)  # the model's folder, read-only (say, a read-only mount)
    assert_one_line_error(r, f"--output {model / HOT_NAME}", "cannot be written")
    monkeypatch.setattr(atomic.os, "access", real_access)

    real_write = HotProfile.write

    def full_disk(self, path):
        if Path(path) == model / HOT_NAME:
            raise OSError(28, "No space left on device")
        real_write(self, path)

    monkeypatch.setattr(HotProfile, "write", full_disk)
    r = _profile_cli(model, prompts)  # the write fails after the measurement: the profile is kept, not lost
    assert_one_line_error(r, "No space left on device", "the profile is kept in", after_start=True)
    kept = Path(r.stderr.split("the profile is kept in ")[1].split(":")[0])
    assert HotProfile.read(kept).tokens > 0
    kept.unlink()
