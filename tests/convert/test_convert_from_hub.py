"""`dsfp4 convert --from-hub`: shards fetched as the parts need them and deleted once converted give the
output of converting a local copy, with the source on disk bounded by a few shards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dsfp4.convert.pipeline as pipeline
from dsfp4.convert.names.family import map_tensors
from dsfp4.convert.plan import ConvertOptions, make_plan
from dsfp4.convert.source.checkpoint import SourceCheckpoint
from dsfp4.convert.source.hub import HubSource
from dsfp4.hub import remote_file as hub_file
from dsfp4.hub.remote_file import HubError
from dsfp4.layout.manifest import Manifest
from tests.fixtures.cli import run_cli
from tests.fixtures.fake_hub import FakeHub
from tests.fixtures.files import reshard, tree_bytes

REPO = "deepseek-ai/DeepSeek-V3"


def _data(out: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree_bytes(out).items() if k.startswith(("backbone/", "experts/"))}


def _by_layer(name: str) -> str:
    """One shard per decoder layer, the rest with layer 0: shards in layer order, as the big releases are."""
    return f"model-{int(name.split('.')[2]) if name.startswith('model.layers.') else 0:05d}.safetensors"


def test_streaming_conversion_matches_a_local_one_and_keeps_few_shards(checkpoints, tmp_path):
    src = tmp_path / "repo"
    reshard(checkpoints["fp8"], src, _by_layer)
    pipeline.convert(src, tmp_path / "local", ConvertOptions(), progress=False)
    converted = tmp_path / "local"
    shards = sorted(p for p in src.glob("*.safetensors"))
    with (
        FakeHub({REPO: src}) as hub,
        HubSource(REPO, tmp_path / "out.source", delete=True, ahead=1, endpoint=hub.url) as source,
    ):
        assert not any(p.suffix == ".safetensors" for p in (tmp_path / "out.source").iterdir())  # headers only
        # one worker: parts are read one after the other (several workers' job window may reach a part further)
        result = pipeline.convert(tmp_path / "out.source", tmp_path / "out", ConvertOptions(workers=1), False, source)
    assert result.done and _data(tmp_path / "out") == _data(converted)
    a, b = Manifest.read(tmp_path / "out"), Manifest.read(converted)
    assert a.tensors == b.tensors and a.experts == b.experts and a.files == b.files
    assert not any((tmp_path / "out.source").glob("*.safetensors"))  # every shard deleted once converted
    biggest = sorted((p.stat().st_size for p in shards), reverse=True)
    assert 0 < source.peak <= sum(biggest[:3]) < sum(biggest)  # a part finalizing, one read, one ahead
    shutil.rmtree(tmp_path / "out.source")


def test_the_peak_estimate_bounds_the_measured_peak_when_parts_share_shards(checkpoints, tmp_path):
    """The tiny checkpoint's own sharding: layers spread over shards that several parts share."""
    with (
        FakeHub({REPO: checkpoints["fp8"]}) as hub,
        HubSource(REPO, tmp_path / "s", delete=True, ahead=1, endpoint=hub.url) as source,
    ):
        (tmp_path / "s" / "precious.txt").write_text("the user's")
        with SourceCheckpoint(tmp_path / "s", remote=source.remote) as src:
            plan = make_plan(
                src,
                map_tensors(
                    src.args,
                    {n: t.info for n, t in src.tensors.items()},
                    {n: t.shard for n, t in src.tensors.items()},
                    "index",
                ),
                ConvertOptions(),
            )
            estimate = source.disk_need([pipeline.part_shards(src, p) for p in plan.parts])
        result = pipeline.convert(tmp_path / "s", tmp_path / "out", ConvertOptions(), False, source)
    assert result.done and 0 < source.peak <= estimate
    source.remove()  # what the run wrote goes; the user's file and so the folder stay
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["precious.txt"]


@pytest.mark.slow
def test_cli_converts_from_the_hub_and_removes_the_source(checkpoints, tmp_path):
    src = tmp_path / "repo"
    reshard(checkpoints["fp8"], src, _by_layer)
    pipeline.convert(src, tmp_path / "local", ConvertOptions(), progress=False)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    with FakeHub({REPO: src}) as hub:
        environ.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"))
        args = ["convert", "--fp4", REPO, str(tmp_path / "out"), "--from-hub", "--delete-source", "-q"]
        command = [sys.executable, "-c", "from dsfp4.cli.main import main; main()", *args]
        r = subprocess.run(command, capture_output=True, text=True, env=environ, timeout=300)
    assert r.returncode == 0, r.stderr
    assert _data(tmp_path / "out") == _data(tmp_path / "local") and not (tmp_path / "out.source").exists()
    r = run_cli("convert", "--fp4", src, tmp_path / "x", "--delete-source")
    assert r.exit_code == 2 and "--delete-source only applies with --from-hub" in r.stderr


def test_a_streaming_conversion_cut_by_the_network_resumes(checkpoints, tmp_path, monkeypatch):
    src = tmp_path / "repo"
    reshard(checkpoints["fp8"], src, _by_layer)
    pipeline.convert(src, tmp_path / "local", ConvertOptions(), progress=False)
    monkeypatch.setattr(hub_file, "RETRY_PAUSES", (0.01,))
    last = sorted(p.name for p in src.glob("*.safetensors"))[-1]
    with FakeHub({REPO: src}) as hub:
        with HubSource(REPO, tmp_path / "out.source", delete=True, ahead=1, endpoint=hub.url) as source:
            hub.drops[last] = 100  # the last shard never arrives: parts before it are converted, then it stops
            with pytest.raises(HubError, match="network failure"):
                pipeline.convert(tmp_path / "out.source", tmp_path / "out", ConvertOptions(), False, source)
        assert not (tmp_path / "out" / "manifest.json").exists()
        hub.drops[last] = 0
        with HubSource(REPO, tmp_path / "out.source", delete=True, ahead=1, endpoint=hub.url) as source:
            result = pipeline.convert(tmp_path / "out.source", tmp_path / "out", ConvertOptions(), False, source)
    assert result.done and result.resumed_parts > 0
    assert _data(tmp_path / "out") == _data(tmp_path / "local")


@pytest.mark.slow
def test_a_second_run_does_not_hash_the_shards_an_earlier_one_checked(checkpoints, tmp_path, monkeypatch):
    src = tmp_path / "repo"
    reshard(checkpoints["fp8"], src, _by_layer)
    hashed: list[str] = []
    real = hub_file.matches
    monkeypatch.setattr(hub_file, "matches", lambda path, f: hashed.append(path.name) or real(path, f))
    with FakeHub({REPO: src}) as hub:
        for out in ("a", "b"):
            hashed.clear()
            with HubSource(REPO, tmp_path / "source", endpoint=hub.url) as source:  # shards kept
                assert pipeline.convert(tmp_path / "source", tmp_path / out, ConvertOptions(), False, source).done
            assert hashed if out == "a" else not hashed, hashed  # checked on arrival, then trusted from the record
