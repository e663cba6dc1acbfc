"""The page-cache peer's projection (dsfp4/projection/page_cache_peer.py): its LRU misses by hand, warm starts and
repeats within a layer; on the whole V3 its time is the sum of its parts, each scaling as its bytes do; the script's
table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsfp4.projection.page_cache_peer import IK_AMPLIFICATION, page_cache_misses, peer_decode
from dsfp4.projection.whole_model import machine_run

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "project_peer.py"


def test_the_page_cache_misses_least_recently_used_records():
    # 1 layer, 2 choices a token, room for 2 records
    run = np.array([[[0, 1]], [[0, 2]], [[1, 0]], [[2, 2]]])
    # cold: 0, 1 miss; 2 misses and pushes out 1 (0 was used since); 1 pushes out 0, 0 pushes out 2; 2 pushes out 1
    assert page_cache_misses(run, [], 2).tolist() == [2, 1, 2, 1]
    # warm with 1 then 0 (1 hottest: last out): the first token hits both, the rest as before
    assert page_cache_misses(run, [(0, 1), (0, 0)], 2).tolist() == [0, 1, 2, 1]
    # a record chosen twice in a step is one read; the second layer's expert 3 is another record
    assert page_cache_misses(np.array([[[3, 3], [3, 0]]]), [], 8).tolist() == [3]


def _trace(tokens: int, layers: int, experts: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(tokens)])


@pytest.mark.slow
def test_the_peer_on_the_whole_v3_is_its_faults_its_cpu_and_its_gpu(tmp_path):
    r = machine_run("v3", "16g", _trace(tokens=40, layers=8, experts=256, k=8), 0.7)
    best, measured = peer_decode(r, 1.0, 96e9), peer_decode(r, IK_AMPLIFICATION, 96e9)
    assert best.ssd_bytes > 0 and measured.ssd_bytes == pytest.approx(best.ssd_bytes * IK_AMPLIFICATION)
    assert measured.ssd_s == pytest.approx(measured.ssd_bytes / r.machine.links.ssd)
    assert best.cpu_s == measured.cpu_s and best.gpu_s == measured.gpu_s and best.gpu_s > 0
    # a scored token's 8 distinct experts in each of the 58 MoE layers, from RAM at the CPU's rate
    assert best.cpu_s == pytest.approx(8 * 58 * r.m.record.nbytes / 96e9)
    assert best.seconds == pytest.approx(best.ssd_s + best.cpu_s + best.gpu_s) and measured.tok_s < best.tok_s
    # overlapped: the larger of the faults and the CPU's work, then the GPU's part
    assert 1 / best.overlapped_tok_s == pytest.approx(max(best.ssd_s, best.cpu_s) + best.gpu_s)
    assert best.tok_s < best.overlapped_tok_s
    # the GPU's part is dsfp4's step without its routed experts
    c = r.costs
    assert best.gpu_s < 58 * (c.attn_s + c.experts_s) + c.other_s
    trace = tmp_path / "t.npy"
    np.save(trace, _trace(tokens=40, layers=8, experts=256, k=8))
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--trace", str(trace), "--efficiency", "0.7", "--machines", "16g"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "dsfp4 / peer" in out and len(out.strip().splitlines()) == 3
