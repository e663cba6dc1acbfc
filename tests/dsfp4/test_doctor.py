"""`dsfp4 doctor`: ceilings measured, saved, read back; the verdict names the slowest link."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from dsfp4.cli.main import cli
from dsfp4.errors import ConfigError
from dsfp4.kernels.cpu import moe as host_moe
from dsfp4.layout.manifest import Manifest
from dsfp4.tools.doctor import SCRATCH, Ceilings, load, table, verdict


@pytest.mark.slow
def test_doctor_measures_a_scratch_file_saves_json_and_cleans_up(tmp_path):
    folder, out = tmp_path / "disk", tmp_path / "doctor.json"
    folder.mkdir()
    r = CliRunner().invoke(cli, ["doctor", str(folder), "--scratch", "64M", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "random records" in r.output and "verdict:" in r.output
    c = load(out)
    assert c.seq_read_gbps > 0 and c.random_read_gbps > 0 and c.cpu_cores >= 1 and c.ram_available > 0
    assert c.disk == str(folder.resolve()) and not (folder / SCRATCH).exists()


def test_doctor_reads_a_converted_models_expert_files_as_they_are(converted, tmp_path):
    before = sorted(p.name for p in converted.iterdir())
    r = CliRunner().invoke(cli, ["doctor", str(converted), "--out", str(tmp_path / "d.json"), "--json"])
    assert r.exit_code == 0, r.output
    c = Ceilings.from_dict(json.loads(r.output))
    assert c.record_bytes == Manifest.read(converted).record.nbytes
    assert (c.cpu_moe_gbps > 0) == host_moe.available()  # the CPU lane's kernel, on the model's record
    assert sorted(p.name for p in converted.iterdir()) == before  # nothing written into the model
    assert c.kernel_paths["routed experts"] == "torch reference" and c.kernel_word == ""  # the CPU's


def test_doctor_shows_the_cards_shape_each_parts_kernel_path_and_what_it_costs():
    from dsfp4.kernels.kernel_paths import Gpu, paths_for

    paths = paths_for(Gpu("NVIDIA GeForce RTX 2080 Ti", (7, 5), 65536, 68))
    c = Ceilings(
        gpu="NVIDIA GeForce RTX 2080 Ti",
        gpu_capability="sm_75",
        gpu_smem=65536,
        gpu_sms=68,
        kernel_paths=paths.parts,
        kernel_word=paths.word,
        hbm_read_gbps=600,
        pinned_h2d_gbps=12,
        random_read_gbps=7,
    )
    shown = table(Ceilings.from_dict(json.loads(json.dumps(c.to_dict()))))
    assert "sm_75, 68 SMs, 64.00 KiB shared memory a block" in shown
    assert (
        re.search(r"\nkernels +routed experts: torch reference\n", shown) and "FP8 backbone: torch reference" in shown
    )
    assert verdict(c)[-1] == f"note: {paths.word}" and "need sm_80" in paths.word


def test_verdict_names_the_slowest_link():
    c = Ceilings(gpu="H100", hbm_read_gbps=3000, pinned_h2d_gbps=50, random_read_gbps=7, record_bytes=1 << 20)
    lines = verdict(c, expert_bytes_per_token=1 << 30)
    assert lines[1].startswith("  SSD") and lines[-1].startswith("verdict: SSD")
    fast_disk = Ceilings(gpu="H100", hbm_read_gbps=3000, pinned_h2d_gbps=25, random_read_gbps=50)
    assert verdict(fast_disk)[-1].startswith("verdict: host->GPU")


def test_a_damaged_doctor_file_is_one_clear_error(tmp_path):
    bad = tmp_path / "doctor.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="run `dsfp4 doctor` again"):
        load(bad)
    r = CliRunner().invoke(cli, ["doctor", str(tmp_path / "missing")])
    assert r.exit_code != 0 and "missing" in r.output
    r = CliRunner().invoke(cli, ["doctor", str(tmp_path), "--scratch", "8M"])
    assert r.exit_code == 1 and "--scratch 8.00 MiB: give at least" in r.output


def test_plan_floor_weighs_each_tier_by_its_share_and_run_plan_prints_it(converted, tmp_path, monkeypatch):
    import dataclasses

    import torch

    from dsfp4.runtime.models.load import plan_run
    from dsfp4.runtime.options import RunOptions
    from dsfp4.runtime.plan.planner import token_bytes
    from dsfp4.tools.doctor import plan_floor

    m = Manifest.read(converted)
    plan = plan_run(m, torch.device("cpu"), torch.float32, 64, RunOptions(device="cpu"), False)
    n = plan.total_records
    plan = dataclasses.replace(plan, gpu_slots=n // 4, ram_slots=n // 2)
    c = Ceilings(gpu="x", hbm_read_gbps=1000.0, pinned_h2d_gbps=50.0, random_read_gbps=5.0)
    backbone, record = token_bytes(m)
    experts = len(plan.expert_layers) * m.args.n_activated_experts * record
    want = max(0.5 * experts / 5e9, 0.75 * experts / 50e9) + (backbone + experts) / 1e12
    assert plan_floor(plan, m, c) == pytest.approx(want)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = CliRunner().invoke(cli, ["run", str(converted), "--plan", "--device", "cpu"])
    assert "run `dsfp4 doctor`" in r.output
    c.save(tmp_path / "dsfp4" / "doctor.json")
    r = CliRunner().invoke(cli, ["run", str(converted), "--plan", "--device", "cpu"])
    assert r.exit_code == 0 and "decode floor at this machine's ceilings" in r.output
