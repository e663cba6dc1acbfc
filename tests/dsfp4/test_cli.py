"""The dsfp4 command line: bad inputs give one line, a non-zero exit and no manifest; verify and inspect."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections import namedtuple

import pytest
from click.testing import CliRunner

from dsfp4.cli.main import cli
from dsfp4.layout.manifest import MANIFEST_NAME, Manifest
from tests.fixtures.cli import assert_one_line_error, run_cli
from tests.fixtures.files import copy_checkpoint, rewrite_header


def _drop_shard(ckpt):
    (ckpt / "model-00002-of-000003.safetensors").unlink()
    return "model-00002-of-000003.safetensors", "missing"


def _truncate_shard(ckpt):
    path = ckpt / "model-00003-of-000003.safetensors"
    os.truncate(path, path.stat().st_size - 1000)
    return "model-00003-of-000003.safetensors", "truncated"


def _drop_from_index(ckpt):
    index = ckpt / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    del d["weight_map"]["model.layers.2.mlp.experts.5.down_proj.weight"]
    index.write_text(json.dumps(d))
    return "model.layers.2.mlp.experts.5.down_proj.weight", "not in model.safetensors.index.json"


def _set_config(ckpt, key, value):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[key] = value
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _wrong_config_shape(ckpt):
    _set_config(ckpt, "moe_intermediate_size", 112)
    return "config.json implies [112, 256]", "shape"


def _unknown_dtype(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.post_attention_layernorm.weight"

    def edit(header):
        header[name]["dtype"] = "I16"  # same width as BF16, so the header stays consistent

    rewrite_header(ckpt / index[name], edit)
    return name, "dtype I16"


def _unexpected_tensor(ckpt):
    index_path = ckpt / "model.safetensors.index.json"
    d = json.loads(index_path.read_text())
    shard = ckpt / d["weight_map"]["model.norm.weight"]
    data_len = shard.stat().st_size - 8 - struct.unpack("<Q", shard.read_bytes()[:8])[0]

    def edit(header):
        header["model.norm.bias"] = {"dtype": "BF16", "shape": [256], "data_offsets": [data_len, data_len + 512]}

    rewrite_header(shard, edit)
    with open(shard, "ab") as f:
        f.write(bytes(512))
    d["weight_map"]["model.norm.bias"] = shard.name
    index_path.write_text(json.dumps(d))
    return "unexpected tensor model.norm.bias", "has no place for it"


def _overlapping_tensors(ckpt):
    d = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / d["weight_map"]["model.norm.weight"]

    def edit(header):
        header["model.norm.weight"]["data_offsets"] = list(header["lm_head.weight"]["data_offsets"])
        header["model.norm.weight"]["data_offsets"][1] = header["model.norm.weight"]["data_offsets"][0] + 512

    rewrite_header(shard, edit)
    return shard.name, "overlap"


def _negative_offset(ckpt):
    d = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / d["weight_map"]["model.norm.weight"]
    rewrite_header(shard, lambda h: h["model.norm.weight"].update(data_offsets=[-512, 0]))
    return "malformed header entry for tensor model.norm.weight", shard.name


def _nan_in_copied_fp8(ckpt):
    from safetensors.torch import load_file, save_file

    d = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    tensors = load_file(ckpt / d[name])
    tensors[name][0, 0] = float("inf")
    save_file(tensors, ckpt / d[name], metadata={"format": "pt"})
    return name, "NaN or Inf"


def _config_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2]")
    return "config.json: expected a JSON object", "error"


def _config_bad_type(ckpt):
    _set_config(ckpt, "moe_layer_freq", 0)
    return "moe_layer_freq must be at least 1", "config.json"


def _index_not_a_map(ckpt):
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": [1]}')
    return "model.safetensors.index.json", "weight_map"


def _nan_weight(ckpt):
    import torch
    from safetensors.torch import load_file, save_file

    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.6.up_proj.weight"
    tensors = load_file(ckpt / index[name])
    w = tensors[name].float()
    w[3, 3] = float("nan")
    tensors[name] = w.to(torch.float8_e4m3fn)
    save_file(tensors, ckpt / index[name], metadata={"format": "pt"})
    return "model.layers.1.mlp.experts.6.up_proj.weight", "NaN"


BAD_INPUTS = [
    _drop_shard,
    _truncate_shard,
    _drop_from_index,
    _wrong_config_shape,
    _unknown_dtype,
    _unexpected_tensor,
    _overlapping_tensors,
    _negative_offset,
    _nan_weight,
    _nan_in_copied_fp8,
    _config_not_an_object,
    _config_bad_type,
    _index_not_a_map,
]


@pytest.mark.parametrize("damage", BAD_INPUTS, ids=lambda f: f.__name__.strip("_"))
def test_bad_source_gives_one_line_and_no_manifest(checkpoints, tmp_path, damage):
    ckpt = copy_checkpoint(checkpoints["fp8"], tmp_path / "src")
    needles = damage(ckpt)
    result = run_cli("convert", "--fp4", ckpt, tmp_path / "out", "-q")
    assert_one_line_error(result, *needles)
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_existing_output_is_not_overwritten(checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep")
    assert_one_line_error(run_cli("convert", "--fp4", checkpoints["fp8"], out, "-q"), "not empty", "--force")
    assert (out / "precious.txt").read_text() == "keep" and not (out / MANIFEST_NAME).exists()


def test_output_below_a_file_is_one_line(checkpoints, tmp_path):
    (tmp_path / "afile").write_text("x")
    assert_one_line_error(run_cli("convert", "--fp4", checkpoints["fp8"], tmp_path / "afile" / "out", "-q"), "afile")


def test_full_disk_mid_run_is_one_line_with_the_fix(checkpoints, tmp_path, monkeypatch):
    import errno

    import dsfp4.layout.writer as writer

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device", "experts/layer-001.bin.partial")

    monkeypatch.setattr(writer, "pwrite_all", full)  # the expert files' records
    result = run_cli("convert", "--fp4", checkpoints["fp8"], tmp_path / "out", "-q")
    assert_one_line_error(result, "No space left on device", "run the same command again")
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_not_enough_disk(checkpoints, tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    result = run_cli("convert", "--fp4", checkpoints["fp8"], tmp_path / "out", "-q")
    assert_one_line_error(result, "not enough free disk space", "1000 B are free")
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_bad_flags_are_usage_errors(checkpoints, tmp_path):
    assert run_cli("convert", checkpoints["fp8"], tmp_path / "o").exit_code == 2  # --fp4 is required
    assert run_cli("convert", "--fp4", "--format", "int4", checkpoints["fp8"], tmp_path / "o").exit_code == 2
    assert_one_line_error(
        run_cli("convert", "--fp4", "--device", "cuda:7", checkpoints["fp8"], tmp_path / "o", "-q"), "--device cuda:7"
    )
    assert_one_line_error(
        run_cli("convert", "--fp4", "--device", "meta", checkpoints["fp8"], tmp_path / "o", "-q"), "--device meta"
    )


def test_dry_run_prints_the_plan(checkpoints, tmp_path):
    result = run_cli("convert", "--fp4", checkpoints["fp8"], tmp_path / "out", "--dry-run")
    assert result.exit_code == 0
    assert "layer-003" in result.stdout and "total" in result.stdout and "fp8_e4m3_b128 -> nvfp4" in result.stdout
    assert not (tmp_path / "out").exists()


def test_convert_prints_the_output_path_last(checkpoints, tmp_path):
    result = run_cli("convert", "--fp4", checkpoints["fp8"], tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == str(tmp_path / "out")
    assert "quantization error experts fp8_e4m3_b128 -> nvfp4" in result.stderr


def test_verify_passes_then_catches_a_flipped_record_byte(converted, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(converted, model)
    ok = run_cli("verify", model, "-q")
    assert ok.exit_code == 0 and "OK" in ok.stdout
    m = Manifest.read(model)
    ef = m.experts[2]
    path = model / ef.file
    data = bytearray(path.read_bytes())
    data[ef.offsets[5] + 100] ^= 0x01
    path.write_bytes(bytes(data))
    assert_one_line_error(run_cli("verify", model, "-q"), "experts/layer-002.bin", "expert 5")


def test_verify_catches_a_damaged_backbone_file(converted, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(converted, model)
    path = model / "backbone/layer-001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    assert_one_line_error(run_cli("verify", model, "-q"), "backbone/layer-001.safetensors", "sha256")


def test_verify_refuses_a_folder_without_manifest(tmp_path):
    assert_one_line_error(run_cli("verify", tmp_path), "manifest.json not found")


def test_inspect_lists_files_formats_and_records(converted):
    result = run_cli("inspect", converted, "--tensors")
    assert result.exit_code == 0
    for needle in ("experts nvfp4", "backbone/layer-001.safetensors", "layers.1.attn.wkv_a", "fp8_e4m3_b128"):
        assert needle in result.stdout


def test_the_command_table_names_every_command_by_its_own_name():
    from dsfp4.cli.main import COMMANDS, load_command

    for name in COMMANDS:
        assert load_command(name).name == name
    listed = CliRunner().invoke(cli, ["--help"]).output
    assert all(f"  {name} " in listed for name in COMMANDS)


def test_help_version_and_an_unknown_command_answer_without_importing_torch():
    """torch takes seconds to import on a CUDA machine: the group's help, its version and a mistyped command import
    no command and none of the libraries."""
    code = (
        "import sys\n"
        "from dsfp4.cli.main import cli\n"
        "for args in (['--help'], ['--version'], ['nope']):\n"
        "    try:\n"
        "        cli(args, prog_name='dsfp4')\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('torch', 'numpy', 'triton', 'dsfp4.cli.run') if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("[]"), r.stdout + r.stderr
    assert "Usage: dsfp4" in r.stdout and "No such command 'nope'" in r.stderr


# the libraries a command's help and its flag errors must not import: torch takes seconds on a CUDA machine
HEAVY = ("torch", "triton", "tokenizers", "safetensors", "llguidance", "numpy")
# one flag error per command, which Click finds before the command runs, and what its message names (MODEL: an
# existing empty folder, OUT: a path that does not exist)
FLAG_ERRORS = {
    "bench": (["MODEL", "--prompts", "0"], "'--prompts'"),
    "chat": (["--temperature", "x"], "'--temperature'"),
    "convert": (["deepseek-ai/DeepSeek-V3", "OUT", "--workers", "0"], "'--workers'"),
    "demo": (["--family", "v5"], "'--family'"),
    "doctor": (["OUT"], "'[FOLDER]'"),
    "download": (["deepseek-ai/DeepSeek-V3", "--local-dir"], "'--local-dir'"),
    "eval": (["MODEL", "--context", "1"], "'--context'"),
    "export": (["MODEL", "OUT", "--format", "safetensors"], "'--format'"),
    "inspect": (["OUT"], "'MODEL'"),
    "profile-hot": (["MODEL", "--tokens", "0"], "'--tokens'"),
    "run": (["MODEL", "--temperature", "x"], "'--temperature'"),
    "verify": ([], "'MODEL'"),
}
CALLS = """
import contextlib, io, json, sys
from dsfp4.cli.main import cli
out = []
for args in json.loads(sys.argv[1]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            cli(args, prog_name="dsfp4")
            code = 0
        except SystemExit as e:
            code = e.code
    loaded = sorted(m for m in json.loads(sys.argv[2]) if m in sys.modules)
    out.append({"args": args, "code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(), "loaded": loaded})
print(json.dumps(out))
"""


def test_every_commands_help_and_flag_errors_answer_without_importing_torch(tmp_path):
    """Each command's --help and a flag it refuses answer from its module without torch and the other libraries:
    a command imports them in its function, once it runs."""
    from dsfp4.cli.main import COMMANDS

    assert set(FLAG_ERRORS) == set(COMMANDS), "give every command of COMMANDS a flag error here"
    paths = {"MODEL": str(tmp_path), "OUT": str(tmp_path / "absent")}
    calls = [[name, "--help"] for name in sorted(COMMANDS)]
    calls += [[name, *(paths.get(a, a) for a in FLAG_ERRORS[name][0])] for name in sorted(COMMANDS)]
    r = subprocess.run(
        [sys.executable, "-c", CALLS, json.dumps(calls), json.dumps(HEAVY)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for call in json.loads(r.stdout):
        name, args = call["args"][0], call["args"]
        assert call["loaded"] == [], f"dsfp4 {' '.join(args)} imported {call['loaded']}"
        if args[1:] == ["--help"]:
            assert call["code"] == 0 and f"Usage: dsfp4 {name}" in call["stdout"], call
        else:
            assert call["code"] == 2 and FLAG_ERRORS[name][1] in call["stderr"], call


def test_debug_shows_the_traceback(tmp_path):
    result = CliRunner().invoke(cli, ["--debug", "verify", str(tmp_path)])
    assert result.exit_code == 1 and result.exception is not None and "ManifestError" in repr(result.exception)


def test_debug_works_after_the_subcommand_too(tmp_path):
    result = CliRunner().invoke(cli, ["verify", str(tmp_path), "--debug"])
    assert result.exit_code == 1 and "ManifestError" in repr(result.exception)
    assert CliRunner().invoke(cli, ["verify", str(tmp_path)]).exception.__class__ is SystemExit  # one line


def test_ctrl_c_exits_130_and_says_how_to_resume(checkpoints, tmp_path, monkeypatch):
    import dsfp4.layout.writer as writer

    def interrupted(*a):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "pwrite_all", interrupted)
    result = run_cli("convert", "--fp4", checkpoints["fp8"], tmp_path / "out", "-q")
    assert result.exit_code == 130 and "interrupted: run the same command again to resume" in result.stderr
    assert "error" not in result.stderr and not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_flags_of_another_mode_name_themselves_in_good_english(converted):
    r = run_cli("run", converted, "--prompt", "hi", "--port", "9000")
    assert r.exit_code == 2 and "--port only applies with --serve" in r.stderr
    r = run_cli("run", converted, "--prompt", "hi", "--port", "9000", "--host", "::1")
    assert "--host, --port only apply with --serve" in r.stderr or "--port, --host only apply" in r.stderr


def test_a_closed_output_pipe_ends_quietly(converted):
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader (`| head`) is gone before the answer comes
    cmd = [sys.executable, "-m", "dsfp4.cli.main", "run", str(converted), "--prompt", "hi", "--device", "cpu", "-q"]
    r = subprocess.run([*cmd, "--max-tokens", "4"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
    os.close(write)
    assert r.returncode == 141 and "Broken pipe" not in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_run_quiet_prints_the_answer_only(converted):
    r = run_cli("run", converted, "--prompt", "hi", "--device", "cpu", "--max-tokens", "3", "-q")
    assert r.exit_code == 0 and r.stdout.strip() and not r.stderr.strip(), r.stderr
