"""`dsfp4 bench`: a run per preset on the tiny model, with the doctor's ceilings, and reports a person can read."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner

from dsfp4.cli.main import cli
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.planner import token_bytes
from dsfp4.tools.bench import prompt_set
from dsfp4.tools.doctor import Ceilings


def test_bench_writes_json_csv_and_html_with_the_ceilings_and_per_layer_hits(converted, tmp_path):
    ceil = tmp_path / "doctor.json"
    Ceilings(gpu="H100", hbm_read_gbps=3000.0, pinned_h2d_gbps=50.0, random_read_gbps=2.0, disk="/nvme").save(ceil)
    out = tmp_path / "report"
    args = ["bench", str(converted), "--device", "cpu", "--prompts", "2", "--max-tokens", "4"]
    r = CliRunner().invoke(cli, [*args, "--max-context", "2048", "--ceilings", str(ceil), "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "bench.json").read_text())
    assert data["ceilings"]["hbm_read_gbps"] == 3000.0 and data["commit"]
    assert data["command"].startswith(f"dsfp4 bench {converted} ") and "--max-tokens 4" in data["command"]
    (res,) = data["results"]
    assert res["prompts"] == 2 and res["decode_tokens"] == 6 and res["decode_tok_s"] > 0
    # the CPU's row says the references ran, with no word (that is what the CPU runs)
    assert res["kernel_paths"]["FP8 backbone"].startswith("torch reference") and res["kernel_word"] == ""
    m = Manifest.read(converted)
    assert set(res["layers"]) == {str(layer) for layer in m.experts if layer < m.args.n_layers}  # not MTP
    assert all(v["uses"] > 0 for v in res["layers"].values())
    per, (backbone, record) = res["bytes_per_token"], token_bytes(m)
    k = m.args.n_activated_experts * len(res["layers"])  # every MoE layer's experts, one token per pass
    assert per["device"] == pytest.approx(backbone + k * record)  # the resident tiny model: no SSD, no copies
    assert per["ssd"] == per["h2d"] == 0
    assert res["floor_s_per_token"] == pytest.approx(per["device"] / 3000e9)
    assert res["efficiency"] == pytest.approx(res["floor_s_per_token"] * res["decode_tok_s"])
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert rows[0]["preset"] == "this machine" and float(rows[0]["decode_tok_s"]) > 0
    page = (out / "bench.html").read_text()
    assert page.count("<svg") == 3 and "where each layer" in page and "against its floor" in page


def test_the_floor_overlaps_ssd_and_pcie_then_adds_the_device():
    c = Ceilings(gpu="x", hbm_read_gbps=1000.0, pinned_h2d_gbps=50.0, random_read_gbps=5.0)
    assert c.floor_s(device_bytes=1e9, ssd_bytes=1e9, h2d_bytes=1e9) == 1e9 / 5e9 + 1e9 / 1e12
    faster = Ceilings(gpu="x", hbm_read_gbps=1000.0, pinned_h2d_gbps=50.0, random_read_gbps=5.0, seq_read_gbps=8.0)
    assert faster.floor_s(device_bytes=1e9, ssd_bytes=1e9, h2d_bytes=0) == 1e9 / 8e9 + 1e9 / 1e12
    assert Ceilings().floor_s(1e9, 0, 0) is None  # no GPU measured: no floor


def test_prompt_set_is_fixed_and_mixes_the_calibration_sets(converted):
    a, b = prompt_set(4), prompt_set(4)
    assert a == b and len(set(a)) == 4
    backbone, record = token_bytes(Manifest.read(converted))
    assert backbone > 0 and record > 0


def test_bench_runs_given_budgets_beside_the_presets_and_records_its_flags(converted, tmp_path):
    ceil = tmp_path / "doctor.json"
    Ceilings(gpu="cpu", hbm_read_gbps=100.0, pinned_h2d_gbps=10.0, random_read_gbps=1.0, disk="/nvme").save(ceil)
    out = tmp_path / "report"
    args = ["bench", str(converted), "--device", "cpu", "--prompts", "1", "--max-tokens", "3", "--preset", "80g"]
    args += ["--gpu-mem", "1G", "--cpu-mem", "1G", "--no-zero-copy", "--policy", "lru", "--expert-threshold", "0.2"]
    r = CliRunner().invoke(cli, [*args, "--ceilings", str(ceil), "--out", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads((out / "bench.json").read_text())
    assert [x["preset"] for x in data["results"]] == ["80g", "--gpu-mem 1G --cpu-mem 1G"]
    assert data["results"][1]["gpu_budget"] == 1 << 30 and "--gpu-mem 1G --cpu-mem 1G" in data["command"]
    assert "--no-zero-copy" in data["command"]  # a flag that is on by default shows only when turned off
    assert "--policy lru" in data["command"] and "--expert-threshold 0.2" in data["command"]  # the store's flags


def test_bench_measures_decode_after_the_cached_prompt_on_deepseek_v4(v4_converted, tmp_path):
    """V4's caches continue only where they stopped: the answer still follows the cached prompt, so a decode
    token's bytes are one token's (no prefill counted in them)."""
    ceil = tmp_path / "doctor.json"
    Ceilings(gpu="cpu", hbm_read_gbps=100.0, pinned_h2d_gbps=10.0, random_read_gbps=1.0, disk="/nvme").save(ceil)
    out = tmp_path / "report"
    args = ["bench", str(v4_converted), "--device", "cpu", "--prompts", "1", "--max-tokens", "3"]
    r = CliRunner().invoke(cli, [*args, "--ceilings", str(ceil), "--out", str(out)])
    assert r.exit_code == 0, r.output
    (res,) = json.loads((out / "bench.json").read_text())["results"]
    m = Manifest.read(v4_converted)
    backbone, record = token_bytes(m)
    k = m.args.n_activated_experts * len(res["layers"])
    assert res["bytes_per_token"]["device"] == pytest.approx(backbone + k * record)


def test_project_needs_a_routing_trace_a_gpu_and_exact_routing(converted, tmp_path):
    ceil = tmp_path / "doctor.json"
    Ceilings(gpu="", random_read_gbps=1.0).save(ceil)
    args = ["bench", str(converted), "--device", "cpu", "--ceilings", str(ceil), "--out", str(tmp_path / "b")]
    r = CliRunner().invoke(cli, [*args, "--project", "v3"])
    assert r.exit_code == 1 and "--project needs --routing TRACE" in r.output
    trace = tmp_path / "t.npy"
    np.save(trace, np.zeros((4, 2, 2), dtype=np.int32))
    r = CliRunner().invoke(cli, [*args, "--project", "v3", "--routing", str(trace)])
    assert r.exit_code == 1 and "--project needs a GPU" in r.output
    r = CliRunner().invoke(cli, [*args, "--project", "v3", "--routing", str(trace), "--mode", "balanced"])
    assert r.exit_code == 1 and "drop --mode balanced" in r.output


def test_a_bad_budget_fails_before_any_run_and_each_run_is_written_as_it_ends(converted, tmp_path, monkeypatch):
    from dsfp4.tools import bench as bench_tools

    ceil = tmp_path / "doctor.json"
    Ceilings(gpu="cpu", hbm_read_gbps=100.0, pinned_h2d_gbps=10.0, random_read_gbps=1.0, disk="/nvme").save(ceil)
    out = tmp_path / "report"
    base = ["bench", str(converted), "--device", "cpu", "--prompts", "1", "--max-tokens", "2", "--ceilings", str(ceil)]
    ran = []
    real = bench_tools.run_preset
    monkeypatch.setattr(bench_tools, "run_preset", lambda *a, **k: ran.append(a[4]) or real(*a, **k))
    r = CliRunner().invoke(cli, [*base, "--preset", "80g", "--gpu-mem", "1M", "--out", str(out)])
    assert r.exit_code == 1 and "--gpu-mem 1.00 MiB is too small" in r.output and not ran  # nothing ran first
    assert not out.exists()

    def fail_second(*a, **k):
        if ran:
            raise RuntimeError("the machine went away")
        ran.append(a[4])
        return real(*a, **k)

    monkeypatch.setattr(bench_tools, "run_preset", fail_second)
    r = CliRunner().invoke(cli, [*base, "--preset", "80g", "--preset", "32g", "--out", str(out)])
    assert r.exit_code != 0
    assert [x["preset"] for x in json.loads((out / "bench.json").read_text())["results"]] == ["80g"]


def test_each_run_follows_the_plan_its_budget_was_checked_with(converted, tmp_path, monkeypatch):
    """A budget is planned once, before the runs: the run does not plan it again in its larger process (where a tight
    budget that passed the check could fail)."""
    from dsfp4.runtime.models import load

    ceil = tmp_path / "doctor.json"
    Ceilings(gpu="cpu", hbm_read_gbps=100.0, pinned_h2d_gbps=10.0, random_read_gbps=1.0, disk="/nvme").save(ceil)
    planned = []
    real = load.plan_run
    monkeypatch.setattr(load, "plan_run", lambda *a, **k: planned.append(a[4].preset) or real(*a, **k))
    args = ["bench", str(converted), "--device", "cpu", "--prompts", "1", "--max-tokens", "2", "--ceilings", str(ceil)]
    r = CliRunner().invoke(cli, [*args, "--preset", "80g", "--preset", "32g", "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    assert planned == ["80g", "32g"]


def test_the_per_layer_chart_labels_shares_as_percentages():
    from dsfp4.tools.bench_report import layer_chart

    svg = layer_chart({"preset": "16g", "layers": {"1": {"uses": 4, "device": 4, "ram": 0}}})
    assert "device: 100.0%" in svg and " ms" not in svg


def test_bench_records_the_commit_of_dsfp4s_own_checkout_only(tmp_path):
    """A copy of the package inside another repository records dsfp4's version, not that repository's HEAD; its own
    checkout adds its commit."""
    import subprocess

    from dsfp4.tools.bench import commit
    from dsfp4.version import __version__

    other = tmp_path / "other"
    (other / "vendored").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(other)]
    subprocess.run([*git, "init", "-q"], check=True)
    (other / "x").write_text("x")
    subprocess.run([*git, "add", "x"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], check=True)
    (other / "vendored" / "pyproject.toml").write_text("")
    assert commit(other / "vendored") == __version__  # inside another repository
    assert commit(tmp_path / "nowhere") == __version__  # no repository at all
    (other / "pyproject.toml").write_text("")
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert commit(other) == f"{__version__}+{head}"  # the repository's own top


def test_a_bench_row_off_the_kernels_at_speed_says_so(converted, tmp_path, monkeypatch):
    import dataclasses

    import dsfp4.tools.bench as bench_tool
    from dsfp4.kernels.kernel_paths import kernel_paths

    word = "sm_75: the torch references run on the GPU, several times slower"

    def slower(device):
        return dataclasses.replace(kernel_paths(device), word=word)

    monkeypatch.setattr(bench_tool, "kernel_paths", slower)
    out = tmp_path / "report"
    args = ["bench", str(converted), "--device", "cpu", "--prompts", "1", "--max-tokens", "2", "--out", str(out)]
    r = CliRunner().invoke(cli, [*args, "--max-context", "512"])
    assert r.exit_code == 0, r.output
    assert word in r.output and json.loads((out / "bench.json").read_text())["results"][0]["kernel_word"] == word


def test_the_simulation_check_also_runs_at_the_disk_rate_the_run_read_at(converted, tmp_path):
    """The check's measured decode beside its simulation twice: at the doctor's disk rate (100 GB/s here, far above
    what the run reads) and at the rate the run's own reads took, slower, so fewer tokens a second."""
    from dsfp4.projection.bench_check import validate
    from dsfp4.projection.simulate import Links, StepCosts

    m = Manifest.open(converted)
    layers, experts, k = len(m.experts), m.args.n_routed_experts, m.args.n_activated_experts
    rng = np.random.default_rng(0)
    ids = [[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(80)]
    trace = tmp_path / "trace.npy"
    np.save(trace, np.array(ids, dtype=np.int32))  # [T, L, K]
    options = RunOptions(device="cpu", routing=trace)
    row = validate(converted, m, trace, "16g", "v3", options, Links(100e9, 1e10), StepCosts(1e-4, 1e-4, 1e-4))
    assert 0 < row["run_disk_gbps"] < 100 and row["measured_ssd_bytes_per_token"] > 0
    assert 0 < row["simulated_at_run_disk_tok_s"] < row["simulated_tok_s"]
    assert row["error_at_run_disk"] == pytest.approx(row["simulated_at_run_disk_tok_s"] / row["measured_tok_s"] - 1)
