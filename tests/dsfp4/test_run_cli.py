"""`dsfp4 run`: a prompt, the chat REPL driven through a pseudo-terminal, and one-line errors."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
import sys
import time

import pytest

from dsfp4.layout.manifest import MANIFEST_NAME, MANIFEST_VERSION
from tests.fixtures.cli import assert_one_line_error, run_cli


def test_run_prints_the_plan_the_completion_then_a_stats_line(converted):
    r = run_cli("run", converted, "--prompt", "hi", "--max-tokens", "6", "--temperature", "0", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()
    plan, last = r.stderr.splitlines()[0], r.stderr.splitlines()[-1]
    assert plan.startswith("budgets") and "expert slots" in r.stderr and "record cache" in r.stderr
    assert last.startswith("[length] prompt ") and "tok/s" in last and "on device" in last
    again = run_cli("run", converted, "--prompt", "hi", "--max-tokens", "6", "--temperature", "0", "--device", "cpu")
    assert again.stdout == r.stdout


def test_bad_models_and_flags_give_one_line_errors(converted, tmp_path):
    assert_one_line_error(run_cli("run", tmp_path, "--prompt", "hi"), "manifest.json not found")
    newer = shutil.copytree(converted, tmp_path / "newer")
    m = json.loads((newer / MANIFEST_NAME).read_text())
    m["format_version"] = MANIFEST_VERSION + 1
    (newer / MANIFEST_NAME).write_text(json.dumps(m))
    later = f"layout version {MANIFEST_VERSION + 1}"
    assert_one_line_error(run_cli("run", newer, "--prompt", "hi"), later, "upgrade dsfp4")
    (newer / MANIFEST_NAME).write_text("{ not json")
    assert_one_line_error(run_cli("run", newer, "--prompt", "hi"), "not valid JSON")
    assert_one_line_error(run_cli("run", converted, "--prompt", "hi", "--device", "tpu"), "--device tpu")
    assert run_cli("run", converted).exit_code == 2  # neither --prompt nor --chat


def test_a_prompt_too_long_is_refused_before_the_model_loads(converted, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr("dsfp4.runtime.engine.load_model", load)
    long = run_cli("run", converted, "--prompt", "hi " * 40, "--max-context", "16", "--device", "cpu")
    assert_one_line_error(long, "the context holds 16", "raise --max-context, up to the model's 2048")
    past = run_cli("run", converted, "--prompt", "hi " * 2100, "--device", "cpu")
    assert_one_line_error(past, "the model's positions end at 2048, whatever --max-context: shorten the prompt")


def test_a_damaged_expert_record_is_caught_at_load(converted, tmp_path):
    model = shutil.copytree(converted, tmp_path / "model")
    path = next((model / "experts").iterdir())
    data = bytearray(path.read_bytes())
    for offset in range(0, len(data), 4096):
        data[offset + 7] ^= 0xFF  # every record of the layer
    path.write_bytes(bytes(data))
    assert_one_line_error(
        run_cli("run", model, "--prompt", "hi", "--device", "cpu", "--max-tokens", "2"),
        "sha256",
        "dsfp4 verify",
        after_start=True,
    )


def _read_until(fd: int, needle: bytes, timeout: float = 60.0) -> bytes:
    out, deadline = b"", time.time() + timeout
    while needle not in out:
        if time.time() > deadline or not select.select([fd], [], [], deadline - time.time())[0]:
            raise AssertionError(f"timed out waiting for {needle!r}; got {out[-500:]!r}")
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the terminal
            break
        out += chunk
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="pseudo-terminal test")
@pytest.mark.slow
def test_chat_repl_in_a_pseudo_terminal(converted):
    master, slave = pty.openpty()
    cmd = [
        sys.executable,
        "-m",
        "dsfp4.cli.main",
        "run",
        str(converted),
        "--chat",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--device",
        "cpu",
    ]
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    try:
        _read_until(master, b"> ")
        for line, expect in (
            (b"/help\n", b"/reset"),
            (b"hello\n", b"> "),
            (b"/stats\n", b"tok/s"),
            (b"/reset\n", b"conversation cleared"),
            (b"/nope\n", b"unknown command"),
        ):
            os.write(master, line)
            _read_until(master, expect)
        os.write(master, b"/quit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(master)


def test_broken_tokenizer_files_and_bad_run_flags_give_one_line_errors(converted, tmp_path):
    model = shutil.copytree(converted, tmp_path / "model")
    assert_one_line_error(run_cli("run", model, "--prompt", "hi", "--stop", ""), "--stop")
    assert_one_line_error(run_cli("run", model, "--prompt", "hi", "--device", "cpu:1"), "--device cpu:1")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": "{% for m in messages %}"}))
    assert_one_line_error(run_cli("run", model, "--prompt", "hi", "--device", "cpu"), "chat template does not compile")
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": None}))
    assert_one_line_error(run_cli("run", model, "--prompt", "hi", "--device", "cpu"), "no chat template", "--raw")
    assert run_cli("run", model, "--prompt", "hi", "--raw", "--device", "cpu", "--max-tokens", "2").exit_code == 0
    (model / "tokenizer_config.json").write_text("{ broken")
    assert_one_line_error(
        run_cli("run", model, "--prompt", "hi", "--device", "cpu"), "tokenizer_config.json", "not valid JSON"
    )
    (model / "tokenizer.json").write_text("{}")
    assert_one_line_error(run_cli("run", model, "--prompt", "hi", "--device", "cpu"), "not a valid tokenizer.json")


def test_a_damaged_backbone_file_is_a_one_line_error(converted, tmp_path):
    model = shutil.copytree(converted, tmp_path / "model")
    path = model / "backbone" / "layer-001.safetensors"
    path.write_bytes(bytes(path.stat().st_size))  # its size intact (a short file fails at open, the next test)
    assert_one_line_error(
        run_cli("run", model, "--prompt", "hi", "--device", "cpu"), "layer-001.safetensors", "dsfp4 verify"
    )


def test_list_form_chat_template_is_used(converted, tmp_path):
    from dsfp4.runtime.generate.tokenizer import ChatTokenizer

    model = shutil.copytree(converted, tmp_path / "model")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": cfg["chat_template"]},
    ]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ChatTokenizer(model).render_chat([{"role": "user", "content": "hi"}]).endswith("hi<｜Assistant｜>")


def test_plan_prints_the_budget_table_and_small_budgets_name_the_minimum(converted):
    r = run_cli("run", converted, "--plan", "--device", "cpu", "--gpu-mem", "2G", "--cpu-mem", "1G")
    assert r.exit_code == 0 and "expert slots" in r.stdout and "--gpu-mem, --cpu-mem" in r.stdout
    preset = run_cli("run", converted, "--plan", "--device", "cpu", "--preset", "16g")
    assert preset.exit_code == 0 and "preset 16g" in preset.stdout
    small = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "--gpu-mem", "1M")
    assert_one_line_error(small, "--gpu-mem 1.00 MiB is too small", "needs at least")
    assert_one_line_error(run_cli("run", converted, "--plan", "--gpu-mem", "lots"), "--gpu-mem 'lots'")


def test_plan_says_when_the_context_is_capped_at_the_models(converted):
    r = run_cli("run", converted, "--plan", "--device", "cpu", "--max-context", "99999999")
    assert r.exit_code == 0 and "is above the model's limit; using" in r.stderr
    j = run_cli("run", converted, "--plan", "--json", "--device", "cpu", "--max-context", "99999999")
    assert json.loads(j.stdout)["max_context"] < 99999999
    assert "above the model's limit" not in run_cli("run", converted, "--plan", "--device", "cpu").stderr


def test_plan_shows_each_parts_kernel_path_and_a_card_nothing_runs_on_is_refused_before_loading(converted, monkeypatch):
    from dsfp4.kernels import kernel_paths as kp

    r = run_cli("run", converted, "--plan", "--device", "cpu")
    assert r.exit_code == 0 and "kernels on CPU:" in r.stdout and "  routed experts: torch reference" in r.stdout
    j = json.loads(run_cli("run", converted, "--plan", "--json", "--device", "cpu").stdout)
    assert j["kernels"]["kernels"] is False and j["kernels"]["parts"]["FP8 backbone"].startswith("torch reference")
    old = kp.paths_for(kp.Gpu("NVIDIA GeForce GTX 1080", (6, 1), 49152, 20, torch_archs=("sm_75", "compute_75")))
    slow = kp.paths_for(kp.Gpu("NVIDIA GeForce RTX 2080 Ti", (7, 5), 65536, 68))
    import dsfp4.runtime.engine as engine_module

    for paths, refused in ((old, True), (slow, False)):
        monkeypatch.setattr(kp, "kernel_paths", lambda device, paths=paths: paths)
        monkeypatch.setattr(engine_module, "kernel_paths", lambda device, paths=paths: paths)
        r = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "--max-tokens", "1")
        if refused:
            assert_one_line_error(r, "GTX 1080 (sm_61): this torch build has no CUDA kernels", "install a torch build")
            assert "expert slots" not in r.stderr  # refused before the plan, before anything loads
        else:
            assert r.exit_code == 0 and r.stderr.startswith("note: NVIDIA GeForce RTX 2080 Ti (sm_75): dsfp4's Triton")
            assert r.stderr.count("RTX 2080 Ti") == 1  # said before the load, not again among the engine's notes
    from dsfp4.runtime.engine import Engine

    with Engine(converted, device="cpu", max_context=64) as engine:  # the Python API's users hear it too
        assert engine.notes[0] == slow.word


def _peak_rss(model, device: str, budget: dict[str, int]) -> float:
    """A real process's (not this test's) peak RSS in bytes, from `run --stats`."""
    args = [a for k, v in budget.items() for a in (k, str(v))]
    cmd = [sys.executable, "-m", "dsfp4.cli.main", "run", str(model), "--prompt", "hi", "--device", device, *args]
    r = subprocess.run([*cmd, "--max-tokens", "4", "--stats"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rss = re.search(r"process RSS ([0-9.]+) (MiB|GiB)", r.stderr)
    return float(rss.group(1)) * (1 << (20 if rss.group(2) == "MiB" else 30))


@pytest.mark.slow
def test_peak_rss_stays_within_the_budgets(converted):
    """On a CPU device both budgets are host memory."""
    budget = {"--gpu-mem": 1536 << 20, "--cpu-mem": 64 << 20}
    assert 0 < _peak_rss(converted, "cpu", budget) <= sum(budget.values())


@pytest.mark.gpu
def test_peak_rss_stays_within_the_ram_budget_on_cuda(converted):
    """On CUDA the RAM budget holds the process, its CUDA libraries (the planner's reserve) and the record cache."""
    budget = {"--gpu-mem": 2 << 30, "--cpu-mem": 5 << 30}
    assert 0 < _peak_rss(converted, "cuda", budget) <= budget["--cpu-mem"]


@pytest.mark.parametrize("damage", [bytes(range(256)), b"[1,2,3]", b"null", b"tensors: []", b"layer key"])
def test_a_damaged_manifest_gives_one_line_in_every_command_and_the_api(converted, tmp_path, damage):
    import dsfp4
    from dsfp4.errors import ManifestError

    model = shutil.copytree(converted, tmp_path / "model")
    d = json.loads((model / MANIFEST_NAME).read_text())
    if damage == b"tensors: []":
        d["tensors"] = []
        damage = json.dumps(d).encode()
    elif damage == b"layer key":
        d["experts"]["layers"]["x"] = d["experts"]["layers"].pop(next(iter(d["experts"]["layers"])))
        damage = json.dumps(d).encode()
    (model / MANIFEST_NAME).write_bytes(damage)
    for args in (("run", model, "--prompt", "hi", "--device", "cpu"), ("verify", model), ("inspect", model)):
        assert_one_line_error(run_cli(*args), str(model / MANIFEST_NAME))
    with pytest.raises(ManifestError, match="manifest"):
        dsfp4.Engine(model, device="cpu")


@pytest.mark.parametrize("damage", ["truncate an expert file", "truncate a backbone file", "remove an expert file"])
def test_a_short_or_missing_file_fails_when_the_model_is_opened(converted, tmp_path, damage):
    """Found at open by a stat per file, in one line, by every command that opens a model (not when a record is
    first read: profile-hot ran 60 s before it failed)."""
    import dsfp4
    from dsfp4.errors import ChecksumError

    model = shutil.copytree(converted, tmp_path / "model")
    m = json.loads((model / MANIFEST_NAME).read_text())
    expert = model / next(iter(m["experts"]["layers"].values()))["file"]
    backbone = model / next(f for f in m["files"] if f.startswith("backbone/"))
    if damage == "remove an expert file":
        expert.unlink()
    else:
        path = expert if "expert" in damage else backbone
        os.truncate(path, path.stat().st_size - 4096)
    broken = str(expert if "expert" in damage else backbone)
    for args in (
        ("run", model, "--prompt", "hi", "--device", "cpu"),
        ("run", model, "--plan", "--device", "cpu"),
        ("inspect", model),
        ("verify", model),
        ("profile-hot", model, "--device", "cpu"),
    ):
        r = run_cli(*args)
        assert_one_line_error(r, broken)
        assert "missing" in r.output if "remove" in damage else "the manifest says" in r.output
    with pytest.raises(ChecksumError, match="convert again"):
        dsfp4.Engine(model, device="cpu")


def test_run_notices_a_flipped_byte_in_the_backbone_and_verify_a_damaged_hot_profile(converted, tmp_path):
    model = shutil.copytree(converted, tmp_path / "model")
    path = model / "backbone" / "layer-001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # a weight's last byte: the file still parses
    path.write_bytes(bytes(data))
    assert_one_line_error(run_cli("run", model, "--prompt", "hi", "--device", "cpu"), str(path), "sha256 mismatch")
    assert run_cli("run", model, "--prompt", "hi", "--device", "cpu", "--max-tokens", "2", "--no-verify").exit_code == 0
    shutil.copy(converted / "backbone" / "layer-001.safetensors", path)
    (model / "hot.json").write_text('{"format": "dsfp4-hot-v1", "layers": {"1": {"counts": [1, 2]}}}')
    assert_one_line_error(run_cli("verify", model), "hot.json")
    assert_one_line_error(run_cli("run", model, "--prompt", "hi", "--device", "cpu"), "hot.json")


def test_thinking_flag_switches_the_v4_prompt_and_is_refused_where_there_is_no_switch(v4_converted, converted):
    from dsfp4.runtime.generate.tokenizer import ChatTokenizer

    tok = ChatTokenizer(v4_converted)
    tails = {}
    for flag in ("--thinking", "--no-thinking"):
        r = run_cli("run", v4_converted, "--prompt", "hi", "--device", "cpu", "--max-tokens", "1", "--json", flag)
        assert r.exit_code == 0, r.output
        tails[flag] = tok.decode(json.loads(r.stdout)["prompt_token_ids"][-1:], keep_special=True)
    assert tails == {"--thinking": "<think>", "--no-thinking": "</think>"}
    assert_one_line_error(run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "--thinking"), "no thinking")
    r = run_cli("run", v4_converted, "--prompt", "hi", "--device", "cpu", "--raw", "--thinking")
    assert r.exit_code == 2 and "which --raw skips" in r.stderr
