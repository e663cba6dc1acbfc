"""The scripts that measure the lossy levers run end to end on the tests' model: scripts/eval_levers.py (KL at the
whole V3's share, one token per forward) and scripts/router_margins.py (how close the router scores its
runners-up)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tests.dsfp4.test_train_small import _script
from tests.fixtures.cli import run_cli

TEXT = "the model reads expert weights from disk and computes tokens, one layer after another. " * 6


def test_eval_levers_reports_each_setting_against_a_reference(converted, tmp_path):
    text, ref = tmp_path / "t.txt", tmp_path / "ref.lp"
    text.write_text(TEXT)
    r = run_cli("eval", converted, "--text", text, "--context", 32, "--save-logits", ref, "-q", "--device", "cpu")
    assert r.exit_code == 0, r.output
    script = _script("eval_levers").main
    args = [str(converted), "0:0", "0.49:0", "latency", "--text", str(text), "--reference", str(ref)]
    r = CliRunner().invoke(script, args)
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.output.splitlines()]
    assert [row["setting"] for row in rows] == ["0:0", "0.49:0", "latency"]
    exact, lossy = rows[0], rows[1]
    assert exact["kl_mean"] < 1e-6 and exact["skipped_share"] == 0  # the reference is exact routing itself
    assert lossy["skipped_share"] > 0 and lossy["ssd_mb_per_token"] < exact["ssd_mb_per_token"]
    one = CliRunner().invoke(script, [*args[:2], "--experts-per-token", "1", *args[4:]])
    assert one.exit_code == 0, one.output
    one = json.loads(one.output)
    assert one["experts_per_token"] == 1 and exact["experts_per_token"] == 2 and one["kl_mean"] > 1e-6
    assert one["ssd_mb_per_token"] < exact["ssd_mb_per_token"]
    r = CliRunner().invoke(script, [str(converted), "fast", "--text", str(text), "--reference", str(ref)])
    assert r.exit_code == 2 and "give a mode" in r.output


def test_router_margins_gives_a_share_per_margin(converted, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    r = CliRunner().invoke(_script("router_margins").main, [str(converted), "--text", str(text), "--tokens", "64"])
    assert r.exit_code == 0, r.output
    margins = json.loads(r.output)["margins"]
    shares = [margins[d]["close"] for d in ("0.01", "0.02", "0.05", "0.1")]
    assert shares == sorted(shares) and all(0 <= s <= 1 for s in shares)
