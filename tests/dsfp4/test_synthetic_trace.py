"""The synthetic routing traces: the router's group-limited selection, determinism, and the fit to the shares of
uses and the next-token reuse they are asked for; the script prints the published figures beside its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsfp4.synthetic.routing_trace import (
    RouterShape,
    figures,
    hit_in_previous,
    reuse,
    route,
    synthetic_trace,
    trace_stats,
    v3_shares,
    zipf_shares,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "synthetic_trace.py"


def test_router_is_group_limited_top_k():
    scores = np.random.default_rng(0).standard_normal((50, 64))
    ids = route(scores, RouterShape(64, 6, groups=8, topk_groups=2))  # [50, 6]
    assert ids.shape == (50, 6)
    assert all(len(set(row)) == 6 and len({e // 8 for e in row}) <= 2 for row in ids.tolist())
    picked = np.take_along_axis(scores, ids, 1)
    assert (np.diff(picked, axis=1) <= 0).all()  # best first


def test_a_trace_follows_its_shares_and_reuse_and_repeats_with_its_seed():
    shape, shares = RouterShape(64, 6, groups=8, topk_groups=4), zipf_shares(3, 64, 0.6, seed=0)  # top share < 1 / k
    a, rho = synthetic_trace(shares, shape, 3000, target_reuse=0.5, seed=0)
    assert a.shape == (3000, 3, 6) and a.dtype == np.int32 and a.min() >= 0 and a.max() < 64
    assert all(len(set(row)) == 6 and len({e // 8 for e in row}) <= 4 for row in a.reshape(-1, 6).tolist())
    assert abs(reuse(a) - 0.5) < 0.03 and 0 < rho < 1
    got = np.stack([np.bincount(a[:, i].ravel(), minlength=64) / a[:, i].size for i in range(3)])
    assert np.abs(got - shares).max() < 0.02  # the groups' distortion fitted away
    assert np.array_equal(a, synthetic_trace(shares, shape, 3000, 0.5, seed=0)[0])
    assert not np.array_equal(a, synthetic_trace(shares, shape, 3000, 0.5, seed=1)[0])
    with pytest.raises(ValueError, match="do not fit a router"):
        synthetic_trace(shares[:, :60], shape, 10, 0.3)


def test_statistics_of_known_traces():
    cycle = np.array([[[0, 1]], [[2, 3]], [[0, 1]], [[2, 3]]])  # [4 tokens, 1 layer, k 2]
    assert reuse(cycle) == 0.0 and hit_in_previous(cycle, 2) == 1.0
    s = trace_stats(cycle, 4)
    assert s["top50"] == 0.5 and s["gini"] == 0.0  # four experts used alike


def test_the_v3_shares_are_the_published_counts():
    shares = v3_shares()
    assert shares.shape == (58, 256) and np.allclose(shares.sum(1), 1)
    top10 = np.sort(shares, 1)[:, ::-1][:, :26].sum(1).mean()
    assert abs(top10 - figures()["deepseek-v3"]["skew"]["top10"]) < 0.01


@pytest.mark.slow
def test_the_script_prints_its_statistics_beside_the_published_ones(tmp_path):
    args = [sys.executable, str(SCRIPT), str(tmp_path / "v3.npy"), "--model", "v3", "--tokens", "300"]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert "0.268" in out and "0.13-0.23 (projected, not published)" in out
    assert np.load(tmp_path / "v3.npy").shape == (300, 58, 8)
