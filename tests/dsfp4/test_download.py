"""`dsfp4 download` against a local stand-in for the hub (tests/fixtures/fake_hub.py), selected with HF_ENDPOINT:
dry run, full download, a dropped connection resumed, a corrupted file caught, disk-space refusal, the
hub's errors, --no-mtp, and the standard cache; a file damaged after its download is refused by convert and fetched
again by download (by its size and mtime, or with --verify by its hash), records without mtimes included."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsfp4.convert.source.checkpoint import source_selection
from dsfp4.errors import ChecksumError, ConfigError, OutputError
from dsfp4.hub import remote_file as hub_file
from dsfp4.hub.download import download, plan_download
from dsfp4.hub.download_record import RECORD_NAME, check_download
from dsfp4.hub.remote_file import HubError
from dsfp4.layout.atomic import lock_folder
from tests.fixtures.cli import assert_one_line_error, run_cli
from tests.fixtures.fake_hub import COMMIT, FakeHub

REPO = "deepseek-ai/DeepSeek-V3"


def _dsfp4(hub: FakeHub, tmp_path: Path, *args, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1", **env)
    return subprocess.run(
        [sys.executable, "-c", "from dsfp4.cli.main import main; main()", "download", *map(str, args)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and lines[-1].startswith("error: "), r.stderr
    assert not any("Traceback" in line for line in lines), r.stderr
    for needle in needles:
        assert needle in lines[-1], lines[-1]


@pytest.fixture
def repo(checkpoints, tmp_path) -> Path:
    """The tiny FP8 checkpoint as a hub repo, with a file the converter does not need."""
    path = Path(shutil.copytree(checkpoints["fp8"], tmp_path / "repo"))
    (path / "README.md").write_text("not needed\n")
    (path / "figures").mkdir()
    (path / "figures" / "plot.png").write_bytes(b"\x89PNG" * 100)
    return path


@pytest.fixture
def big_repo(tmp_path) -> Path:
    """A repo with a 24 MiB shard, cut mid-file in the tests."""
    path = tmp_path / "big"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 1}))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.layers.0.a": "big.safetensors"}})
    )
    (path / "big.safetensors").write_bytes(os.urandom(24 << 20))
    return path


def _same_files(src: Path, dst: Path) -> None:
    want = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file() and p.name != "README.md"}
    assert {n: (dst / n).read_bytes() for n in want} == want


@pytest.mark.slow
def test_dry_run_lists_the_needed_files_at_one_commit_and_writes_nothing(repo, tmp_path):
    with FakeHub({REPO: repo}) as hub:
        r = _dsfp4(hub, tmp_path, REPO, "--local-dir", tmp_path / "out", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"commit {COMMIT}" in r.stdout and "model-00001-of-000003.safetensors" in r.stdout
    assert "README.md" not in r.stdout and "plot.png" not in r.stdout and "free" in r.stdout
    assert "not one of the checkpoints" not in r.stdout
    assert not (tmp_path / "out").exists()


def _resumed_from(hub: FakeHub, name: str) -> list[int]:
    """Start offsets of the Range requests for `name`."""
    return [int(rng[6:].split("-")[0]) for method, path, rng in hub.requests if path.endswith(name) and rng]


@pytest.mark.slow
def test_download_gets_the_needed_files_and_a_rerun_fetches_nothing(repo, tmp_path):
    out = tmp_path / "out"
    with FakeHub({REPO: repo}) as hub:
        r = _dsfp4(hub, tmp_path, REPO, "--local-dir", out, "-q")
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == str(out)
        _same_files(repo, out)
        assert not (out / "README.md").exists() and not (out / "figures").exists()
        record = json.loads((out / ".dsfp4-download.json").read_text())
        assert record["commit"] == COMMIT and len(record["verified"]) == 8  # 3 shards, index, 4 aux files
        hub.requests.clear()
        assert _dsfp4(hub, tmp_path, REPO, "--local-dir", out, "-q").returncode == 0
        assert not any("/resolve/" in path for _, path, _ in hub.requests)  # verified files are not fetched again


@pytest.mark.slow
def test_a_dropped_connection_is_resumed_within_the_run_and_across_runs(big_repo, tmp_path, monkeypatch):
    out = tmp_path / "out"
    with FakeHub({REPO: big_repo}) as hub:
        hub.drop_at = 12 << 20
        hub.drops["big.safetensors"] = 1  # once: the download asks for the rest itself
        r = _dsfp4(hub, tmp_path, REPO, "--local-dir", out, "-q")
        assert r.returncode == 0, r.stderr
        assert _resumed_from(hub, "big.safetensors") == [12 << 20]
        _same_files(big_repo, out)
    out2 = tmp_path / "out2"
    with FakeHub({REPO: big_repo}) as hub:
        hub.drop_at = 12 << 20
        hub.drops["big.safetensors"] = 100  # for good: more than the download's retries
        monkeypatch.setattr(hub_file, "RETRY_PAUSES", (0.05,) * 3)
        plan = plan_download(REPO, local_dir=out2, selection=source_selection(), endpoint=hub.url)
        with pytest.raises(HubError, match="network failure .* run the same command again to resume"):
            download(plan)
        assert not (out2 / "big.safetensors").exists()
        hub.drops["big.safetensors"] = 0
        hub.requests.clear()
        plan = plan_download(REPO, local_dir=out2, selection=source_selection(), endpoint=hub.url)
        partial = plan.partial
        assert partial >= 12 << 20 and plan.need == (24 << 20) - partial  # the small files are done
        assert _dsfp4(hub, tmp_path, REPO, "--local-dir", out2, "-q").returncode == 0
        assert _resumed_from(hub, "big.safetensors") == [partial]  # the next run goes on from the partial file
    _same_files(big_repo, out2)


@pytest.mark.slow
def test_a_corrupted_file_is_caught_removed_and_fetched_again(repo, tmp_path):
    out = tmp_path / "out"
    shard = "model-00002-of-000003.safetensors"
    with FakeHub({REPO: repo}) as hub:
        hub.corrupt.add(shard)
        _one_line_error(_dsfp4(hub, tmp_path, REPO, "--local-dir", out, "-q"), shard, "sha256", "run the same command")
        assert not (out / shard).exists()
        assert shard not in json.loads((out / ".dsfp4-download.json").read_text())["verified"]
        hub.corrupt.clear()
        assert _dsfp4(hub, tmp_path, REPO, "--local-dir", out, "-q").returncode == 0
    _same_files(repo, out)


@pytest.mark.slow
def test_refusals_disk_space_unknown_repo_gated_repo_bad_revision(repo, tmp_path):
    gated = "deepseek-ai/DeepSeek-R1"
    with FakeHub({REPO: repo, gated: repo}, gated=(gated,), token="hf_secret") as hub:
        small = tmp_path / "small"
        plan = plan_download(REPO, local_dir=small, selection=source_selection(), endpoint=hub.url)
        plan.free = 1000  # as a nearly full disk would measure
        with pytest.raises(OutputError, match=r"needs 4\.[0-9]+ MiB, 1000 B is free; free some space"):
            download(plan)
        assert not small.exists() and not any("/resolve/" in path for _, path, _ in hub.requests)
        _one_line_error(_dsfp4(hub, tmp_path, "nobody/nothing", "--dry-run"), "nobody/nothing", "no such repository")
        _one_line_error(_dsfp4(hub, tmp_path, gated, "--dry-run"), gated, "gated", "--token")
        assert _dsfp4(hub, tmp_path, gated, "--dry-run", "--token", "hf_secret").returncode == 0
        assert _dsfp4(hub, tmp_path, gated, "--dry-run", HF_TOKEN="hf_secret").returncode == 0
        _one_line_error(_dsfp4(hub, tmp_path, REPO, "--revision", "v9", "--dry-run"), "revision v9 not found")
        _one_line_error(_dsfp4(hub, tmp_path, REPO, "--dry-run", HF_HUB_OFFLINE="1"), "HF_HUB_OFFLINE is set")


@pytest.mark.slow
def test_no_mtp_leaves_out_shards_that_hold_only_the_mtp_layer(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_nextn_predict_layers": 1}))
    weight_map = {"model.layers.0.a": "s1.safetensors", "model.layers.1.a": "s2.safetensors"}
    weight_map |= {"model.layers.2.a": "s2.safetensors", "model.layers.2.b": "s3.safetensors"}
    (repo / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name in ("s1", "s2", "s3"):
        (repo / f"{name}.safetensors").write_bytes(name.encode() * 1000)
    with FakeHub({REPO: repo}) as hub:
        r = _dsfp4(hub, tmp_path, REPO, "--local-dir", tmp_path / "out", "--no-mtp", "-q")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").glob("*.safetensors")) == ["s1.safetensors", "s2.safetensors"]
    assert "s3.safetensors  (MTP layer only, --no-mtp)" in r.stderr


@pytest.mark.slow
def test_without_local_dir_the_files_go_to_the_standard_cache(repo, tmp_path):
    with FakeHub({REPO: repo}) as hub:
        r = _dsfp4(hub, tmp_path, REPO, "-q")
    assert r.returncode == 0, r.stderr
    snapshot = tmp_path / "hf-home" / "hub" / "models--deepseek-ai--DeepSeek-V3" / "snapshots" / COMMIT
    assert r.stdout.strip() == str(snapshot)
    _same_files(repo, snapshot)


@pytest.mark.slow
def test_stale_files_stalls_busy_answers_and_a_held_lock(repo, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # left from elsewhere: checked, not trusted
    (out / "tokenizer.json").write_bytes(b"x" * (repo / "tokenizer.json").stat().st_size)  # right size, wrong bytes
    with FakeHub({REPO: repo}) as hub:
        stalled = "model-00001-of-000003.safetensors"
        hub.stalls[stalled] = 1
        hub.stall_s, hub.busy["model-00002-of-000003.safetensors"] = 30.0, 2
        r = _dsfp4(hub, tmp_path, REPO, "--local-dir", out, "-q", HF_HUB_DOWNLOAD_TIMEOUT="1")
        assert r.returncode == 0, r.stderr
        _same_files(repo, out)
        gets = [
            t
            for (m, p, _), t in zip(hub.requests, hub.request_times, strict=True)
            if m == "GET" and p.endswith(stalled)
        ]
        assert len(gets) == 2 and gets[1] - gets[0] < 10  # the client gave up on the silent connection, not the server
        with pytest.raises(OutputError, match="another dsfp4 download is writing"):
            fd = lock_folder(out, "held")
            try:
                download(plan_download(REPO, local_dir=out, selection=source_selection(("*.md",)), endpoint=hub.url))
            finally:
                os.close(fd)
        hub.corrupt.add("tokenizer_config.json")  # not an LFS file: checked by its git blob id
        (out / ".dsfp4-download.json").unlink()
        (out / "tokenizer_config.json").unlink()
        _one_line_error(_dsfp4(hub, tmp_path, REPO, "--local-dir", out, "-q"), "tokenizer_config.json", "git blob id")
        _one_line_error(_dsfp4(hub, tmp_path, "not a repo!", "--dry-run"), "not a valid repo id")


@pytest.mark.slow
def test_the_cache_it_fills_is_the_one_huggingface_hub_reads(repo, tmp_path):
    from huggingface_hub import try_to_load_from_cache

    with FakeHub({REPO: repo}) as hub:
        assert _dsfp4(hub, tmp_path, REPO, "-q").returncode == 0
    cache = tmp_path / "hf-home" / "hub"
    for revision in ("main", COMMIT):
        got = try_to_load_from_cache(REPO, "model-00002-of-000003.safetensors", cache_dir=cache, revision=revision)
        assert Path(got).read_bytes() == (repo / "model-00002-of-000003.safetensors").read_bytes()


def _flip(path: Path, keep_mtime: bool = False) -> None:
    """One byte of `path` flipped in place; keep_mtime: its mtime put back, as damage the file's times do not show."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif path.stat().st_mtime_ns == st.st_mtime_ns:
        # written within the same tick of the file clock as the download's last write: a later one moves it
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert path.stat().st_size == st.st_size


def _convert(src: Path, out: Path, *flags: str):
    return run_cli("convert", "--fp4", src, out, "--device", "cpu", "-q", *flags)


@pytest.mark.slow
def test_a_file_damaged_after_its_download_is_refused_by_convert_and_fetched_again(repo, tmp_path):
    out, shard = tmp_path / "out", "model-00002-of-000003.safetensors"
    with FakeHub({REPO: repo}) as hub:
        download(plan_download(REPO, local_dir=out, selection=source_selection(), endpoint=hub.url))
        files = json.loads((out / RECORD_NAME).read_text())["files"]
        assert files[shard]["mtime_ns"] == (out / shard).stat().st_mtime_ns  # checked, and when
        _flip(out / shard)
        r = _convert(out, tmp_path / "model")
        assert_one_line_error(r, f"{out / shard}: its sha256 differs", "download it again")
        assert_one_line_error(r, f"dsfp4 download {REPO} --revision {COMMIT} --local-dir {out}")
        assert not (tmp_path / "model" / "manifest.json").exists()
        plan = plan_download(REPO, local_dir=out, selection=source_selection(), endpoint=hub.url)
        assert plan.changed == {shard} and plan.need == (repo / shard).stat().st_size  # not 0.00B
        assert f"{shard}  (changed since an earlier run checked it: fetched again)" in plan.table()
        hub.requests.clear()
        download(plan)
        assert [p for _, p, _ in hub.requests if "/resolve/" in p] == [f"/{REPO}/resolve/{COMMIT}/{shard}"]
        _same_files(repo, out)
        assert _convert(out, tmp_path / "model").exit_code == 0
        # damage the mtime does not show: only --verify hashes the file
        _flip(out / shard, keep_mtime=True)
        assert check_download(out) == 8
        assert_one_line_error(_convert(out, tmp_path / "model2", "--verify"), f"{out / shard}: its sha256 differs")
        assert not plan_download(REPO, local_dir=out, selection=source_selection(), endpoint=hub.url).changed
        r = _dsfp4(hub, tmp_path, REPO, "--local-dir", out, "-q", "--verify")
        assert r.returncode == 0, r.stderr
        _same_files(repo, out)  # fetched again


@pytest.mark.slow
def test_a_record_without_mtimes_is_read_and_its_files_hashed_once(repo, tmp_path, monkeypatch):
    out, shard = tmp_path / "out", "model-00001-of-000003.safetensors"
    with FakeHub({REPO: repo}) as hub:
        download(plan_download(REPO, local_dir=out, selection=source_selection(), endpoint=hub.url))
        record = json.loads((out / RECORD_NAME).read_text())
        for entry in record["files"].values():  # as an earlier dsfp4 wrote it
            del entry["mtime_ns"]
        (out / RECORD_NAME).write_text(json.dumps(record))
        _flip(out / shard, keep_mtime=True)
        with pytest.raises(ChecksumError, match=f"{shard}: its sha256 differs"):
            check_download(out)  # no mtime to trust: hashed
        hashed: list[str] = []
        real = hub_file.matches
        monkeypatch.setattr(hub_file, "matches", lambda path, f: hashed.append(path.name) or real(path, f))
        plan = plan_download(REPO, local_dir=out, selection=source_selection(), endpoint=hub.url)
        assert plan.changed == {shard} and len(hashed) == 8  # every file hashed against the hub's listing
        download(plan)
        assert all("mtime_ns" in e for e in json.loads((out / RECORD_NAME).read_text())["files"].values())
        hashed.clear()
        assert not plan_download(REPO, local_dir=out, selection=source_selection(), endpoint=hub.url).changed
        assert not hashed  # the mtimes now recorded: nothing hashed again
    _same_files(repo, out)


def test_convert_verify_needs_a_download_record(checkpoints, tmp_path):
    r = _convert(checkpoints["fp8"], tmp_path / "model", "--verify")
    assert_one_line_error(r, f"--verify: {checkpoints['fp8']} has no {RECORD_NAME}", "drop --verify")
    with pytest.raises(ConfigError):
        check_download(checkpoints["fp8"], verify=True)
    assert check_download(checkpoints["fp8"]) == 0


@pytest.mark.slow
def test_a_cached_snapshot_is_checked_against_the_record_beside_it(repo, tmp_path):
    shard = "model-00003-of-000003.safetensors"
    with FakeHub({REPO: repo}) as hub:
        assert _dsfp4(hub, tmp_path, REPO, "-q").returncode == 0
        snapshot = tmp_path / "hf-home" / "hub" / "models--deepseek-ai--DeepSeek-V3" / "snapshots" / COMMIT
        _flip((snapshot / shard).resolve())  # the blob the snapshot links to
        r = _convert(snapshot, tmp_path / "model")
        assert_one_line_error(
            r, f"{snapshot / shard}: its sha256 differs", f"(dsfp4 download {REPO} --revision {COMMIT})"
        )
        assert _dsfp4(hub, tmp_path, REPO, "-q").returncode == 0  # fetched again
    _same_files(repo, snapshot)
    assert _convert(snapshot, tmp_path / "model").exit_code == 0


def test_a_damaged_record_entry_is_no_check_rather_than_a_traceback():
    from dsfp4.hub.download_record import checked_files

    record = {
        "verified": ["a", "b", "c"],
        "files": {"a": {"blob": "x", "size": None}, "b": {"blob": "y", "size": 3, "mtime_ns": "bad"}, "c": 7},
    }
    got = checked_files(record)
    assert list(got) == ["b"] and got["b"].file.size == 3 and got["b"].mtime_ns is None
    assert checked_files({"verified": "a", "files": {"a": {"blob": "x", "size": 1}}}) == {}
