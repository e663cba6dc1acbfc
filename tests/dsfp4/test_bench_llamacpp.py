"""scripts/bench_llamacpp.py drives mainline llama.cpp and ik_llama.cpp: each peer's compile line for the greedy
check, ik's llama-bench JSON turned into rows, and the disk bytes of a test's timed runs where ik's llama-bench marks
only each test's end (its CSV line on stderr), read from a fake llama-bench in a fake cgroup."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_llamacpp.py"
# the fake's timed runs: a warm-up burst read before them must not count, their own reads must
WARMUP_BYTES, TIMED_BYTES, TIMED_S, STEPS = 5_000_000_000, 2_000_000_000, 1.0, 10


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_llamacpp"] = module
    spec.loader.exec_module(module)
    return module


def fake_llama_bench(build: Path, counter: Path) -> Path:
    """BUILD/bin/llama-bench that behaves as ik's: each test (a prompt one, then a decode one) reads a warm-up burst,
    then reads TIMED_BYTES evenly over TIMED_S (the disk counter is a file), then prints its CSV line on stderr if
    asked (-oe csv) and sets up the next; JSON on stdout; its arguments are kept in BUILD/argv.json."""
    exe = build / "bin" / "llama-bench"
    exe.parent.mkdir(parents=True)
    body = f"""
        import json, os, sys, time
        from pathlib import Path
        Path({str(build / "argv.json")!r}).write_text(json.dumps(sys.argv[1:]))
        Path({str(build / "pinned.json")!r}).write_text(json.dumps(os.environ.get("GGML_CUDA_NO_PINNED")))
        counter, done = Path({str(counter)!r}), 0

        def count(n):  # whole, for the poller
            Path(str(counter) + ".new").write_text(str(n))
            os.replace(str(counter) + ".new", counter)
        csv = "-oe" in sys.argv
        if csv:
            print("build_commit,n_prompt,n_gen", file=sys.stderr, flush=True)
        tests = []
        for n_prompt, n_gen in ((64, 0), (0, 32)):
            done += {WARMUP_BYTES}
            count(done)
            time.sleep(0.3)
            for _ in range({STEPS}):
                time.sleep({TIMED_S / STEPS})
                done += {TIMED_BYTES // STEPS}
                count(done)
            if csv:
                print(f'"x","{{n_prompt}}","{{n_gen}}"', file=sys.stderr, flush=True)
            time.sleep(0.3)  # the next test's context, before its warm-up reads
            tests.append({{"n_prompt": n_prompt, "n_gen": n_gen, "avg_ts": 10.0 + n_gen,
                           "samples_ns": [{int(TIMED_S * 1e9)}], "samples_ts": [10.0 + n_gen]}})
        print(json.dumps(tests))
    """
    exe.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    exe.chmod(0o755)
    return exe


def test_each_peer_compiles_the_greedy_check_against_its_own_libraries(bench, tmp_path):
    src, build, exe = tmp_path / "src", tmp_path / "build", tmp_path / "llama_greedy"
    mainline = bench.greedy_command(src, build, exe, bench.PEERS["llama.cpp"])
    ik = bench.greedy_command(src, build, exe, bench.PEERS["ik"])
    assert ["-L", str(build / "bin")] == mainline[mainline.index("-L") : mainline.index("-L") + 2]
    assert "-lggml-base" in mainline and "-DIK_LLAMA" not in mainline
    # ik's libllama and libggml stay in their CMake folders
    assert "-DIK_LLAMA" in ik and "-lggml-base" not in ik
    assert str(build / "src") in ik and str(build / "ggml" / "src") in ik
    assert f"-Wl,-rpath,{build / 'ggml' / 'src'}" in ik


def test_ik_rows_name_ik_and_its_llama_bench_gets_ik_flags(bench, tmp_path):
    build = tmp_path / "build"
    fake_llama_bench(build, tmp_path / "counter")
    ik = bench.PEERS["ik"]
    rows, own = bench.llama_rows(build, ["-m", "x.gguf", *ik.flags, "-o", "json"], "CPU only", None, "uncapped", ik)
    assert [(r["engine"], r["kind"], r["tok_s"]) for r in rows] == [
        ("ik_llama.cpp", "prefill", 10.0),
        ("ik_llama.cpp", "decode", 42.0),
    ]
    argv = json.loads((build / "argv.json").read_text())
    # ik's llama-bench refuses mainline's -lm and --progress
    assert "-mmp" in argv and "-lm" not in argv and "--progress" not in argv and own == 0


def test_ik_runs_its_mmapped_placement_with_pinned_host_copies_off(bench, tmp_path, monkeypatch):
    """ik copies what it places on the CPU into pinned host memory under CUDA: the SSD-bound run (and its own
    memory's measurement) must keep its experts mmapped; every other run is left as its users run it."""
    monkeypatch.delenv("GGML_CUDA_NO_PINNED", raising=False)
    build = tmp_path / "build"
    fake_llama_bench(build, tmp_path / "counter")
    ik, mainline = bench.PEERS["ik"], bench.PEERS["llama.cpp"]
    for peer, mapped, seen in ((ik, True, "1"), (ik, False, None), (mainline, True, None)):
        bench.llama_rows(build, ["-m", "x.gguf", "-o", "json"], "p", None, "uncapped", peer, mapped=mapped)
        assert json.loads((build / "pinned.json").read_text()) == seen


def test_an_ik_tests_disk_reads_are_its_timed_runs_alone(bench, tmp_path, monkeypatch):
    build, counter, group = tmp_path / "build", tmp_path / "counter", tmp_path / "cgroup"
    fake_llama_bench(build, counter)
    group.mkdir()
    (group / "memory.stat").write_text("anon 1000\nfile 2000\n")
    monkeypatch.setattr(bench, "disk_read_bytes", lambda: int(counter.read_text()) if counter.exists() else 0)
    ik = bench.PEERS["ik"]
    cgroup = bench.MemoryCgroup(group, True)
    rows, own = bench.llama_rows(build, ["-m", "x.gguf", "-o", "json"], "capped", cgroup, "a cap", ik)
    assert own == 1000 and [r["kind"] for r in rows] == ["prefill", "decode"]
    for r, tokens in zip(rows, (64, 32), strict=True):
        # the polls (every 0.1 s) place the timed runs' start on the counter's ramp: the warm-up burst is left out
        read = r["disk_gb_per_token"] * tokens * 1e9
        assert TIMED_BYTES / 2 < read < TIMED_BYTES + WARMUP_BYTES / 2, read
        assert r["disk_gb_s"] == pytest.approx(read / TIMED_S / 1e9)
        assert r["peak_cache_gb"] == pytest.approx(2e-6) and r["peak_own_gb"] == pytest.approx(1e-6)


def test_the_disk_count_between_polls_is_interpolated(bench):
    watched = bench.Watched(b"", [('"csv line"', 5.0, 5000)], disk=[(1.0, 1000), (3.0, 3000), (6.0, 6000)])
    assert watched.disk_at(4.0) == pytest.approx(4000)
    assert watched.disk_at(0.0) == 1000 and watched.disk_at(9.0) == 6000
    assert watched.test_reads(0, 2.5) == (2500, 2.5)


def test_placements_another_peer_lacks_are_refused(bench, tmp_path):
    from click.testing import CliRunner

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    args = ["bench", str(tmp_path), str(gguf), "--llama-cpp", str(tmp_path), "--placement", "exps-cpu-rtr"]
    result = CliRunner().invoke(bench.main, args)
    assert result.exit_code == 2 and "llama.cpp has no such placement" in result.output
