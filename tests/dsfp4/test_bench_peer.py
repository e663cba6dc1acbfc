"""scripts/bench_peer.py: the converted model exported for transformers gives the same greedy tokens under
accelerate's offloading as dsfp4 does, and the comparison is written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_PEER = Path(__file__).resolve().parents[2] / "scripts" / "bench_peer.py"


@pytest.mark.slow
def test_the_peer_decodes_the_same_tokens_as_dsfp4(converted, tmp_path):
    pytest.importorskip("accelerate")
    model = tmp_path / "model"
    shutil.copytree(converted, model)
    args = [
        sys.executable,
        str(BENCH_PEER),
        str(model),
        "--device",
        "cpu",
        "--tokens",
        "6",
        "--out",
        str(tmp_path / "out"),
    ]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    res = json.loads((tmp_path / "out" / "bench_peer.json").read_text())
    peer, ours = res["transformers_accelerate"], res["dsfp4"]
    assert peer["token_ids"] == ours["token_ids"] and len(ours["token_ids"]) == 6
    assert peer["decode_tok_s"] > 0 and ours["decode_tok_s"] > 0 and res["speedup"] > 0
    assert res["first_logits_cosine"] > 0.999 and res["first_logits_max_diff_over_std"] < 0.1  # bf16 vs fp32
    assert peer["placement"] == ["cpu"]
    hf = tmp_path / "model-hf"
    assert (hf / "model.safetensors.index.json").is_file() and not (tmp_path / "model-hf.partial").exists()
    assert "same greedy tokens: True" in out
