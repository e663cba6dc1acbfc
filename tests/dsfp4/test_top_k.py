"""Top-k reduction on routing traces (dsfp4/projection/top_k.py) and in the whole model's projection
(whole_model.machine_run, levers.project_levers, scripts/project_levers.py --experts-per-token)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from dsfp4.errors import ConfigError
from dsfp4.layout.routing_trace import RoutingTrace, write_trace
from dsfp4.projection.levers import project_levers
from dsfp4.projection.top_k import heaviest_weights, keep, same_drop
from dsfp4.projection.whole_model import machine_run
from dsfp4.runtime.modes import EXACT, Levers
from tests.dsfp4.test_simulate import _trace
from tests.dsfp4.test_train_small import _script


def test_an_ids_only_trace_keeps_its_first_k_choices():
    ids = np.array([[[5, 3, 9, 1]], [[2, 7, 4, 6]]])  # [N, L, K] best first
    assert keep(ids, 3).tolist() == [[[5, 3, 9]], [[2, 7, 4]]]
    assert keep(ids, 0) is ids and keep(ids, 4) is ids


def test_a_weighted_trace_keeps_each_tokens_heaviest_choices_heaviest_first():
    # the router's top-k order is by selection score: the weights need not fall along it
    ids = np.array([[[5, 3, 9, 1]], [[2, 7, 4, 6]]])
    weights = np.array([[[0.3, 0.1, 0.4, 0.2]], [[0.1, 0.2, 0.3, 0.4]]])
    assert keep(ids, 2, weights).tolist() == [[[9, 5]], [[6, 4]]]
    assert heaviest_weights(weights, 2).tolist() == [[[0.4, 0.3]], [[0.4, 0.3]]]


def test_more_experts_than_the_trace_routes_to_is_refused():
    with pytest.raises(ConfigError, match="--experts-per-token 5: the trace routes each token to 4"):
        keep(np.zeros((2, 1, 4), dtype=np.int64), 5)


def test_the_recorded_model_drops_as_many_experts_as_the_whole_one():
    assert same_drop(7, 8, 6) == 5 and same_drop(6, 8, 6) == 4
    assert same_drop(0, 8, 6) == 0 and same_drop(8, 8, 6) == 0
    with pytest.raises(ConfigError, match="too few to drop 6"):
        same_drop(2, 8, 6)


@pytest.mark.slow
def test_fewer_experts_a_token_read_and_copy_fewer_bytes_on_the_whole_model():
    ids = _trace(tokens=60, layers=8, experts=256, k=8)
    every, fewer = (machine_run("v3", "16g", ids, 0.7, experts_per_token=k) for k in (0, 6))
    assert every.run.shape[-1] == 8 and fewer.run.shape[-1] == 6
    assert fewer.m.args.n_activated_experts == 6 and fewer.costs.experts_s < every.costs.experts_s
    a, b = (r.decode("hot", 0.9, False) for r in (every, fewer))
    # a token's records: 6 of 8 uses
    assert b.uses == pytest.approx(a.uses * 6 / 8)
    assert b.ssd_bytes < a.ssd_bytes and b.pcie_bytes < a.pcie_bytes and b.tok_s > a.tok_s


def test_v4_flash_refuses_fewer_experts_for_its_hash_layers():
    with pytest.raises(ConfigError, match="route by a table"):
        machine_run("v4", "16g", _trace(tokens=8, layers=4, experts=256, k=6), 0.7, experts_per_token=5)


@pytest.mark.slow
def test_project_levers_gives_a_row_per_experts_per_token_and_reads_the_threshold_on_as_many_dropped():
    ids = _trace(tokens=60, layers=8, experts=256, k=8)
    # recorded weights of 6 experts: the two lightest weigh 0.05 each
    weights = np.tile(np.array([0.3, 0.25, 0.2, 0.15, 0.05, 0.05]), (50, 4, 1))
    modes = {"exact": EXACT, "t": Levers(0.1, 0.0)}
    rows = project_levers("v3", ids, ["16g"], 0.7, modes, weights, {}, experts_per_token=(0, 6))
    by = {(r.mode, r.experts_per_token): r for r in rows}
    assert by[("t", 0)].low_share == pytest.approx(2 / 5)
    # 6 of 8 drops two: the recorded 4 heaviest are all above 0.1 of their sum
    assert by[("t", 6)].low_share == 0.0 and by[("t", 6)].to_dict()["experts_per_token"] == 6
    assert by[("exact", 6)].projection.ssd_bytes < by[("exact", 0)].projection.ssd_bytes


def test_the_script_refuses_fewer_experts_on_v4_in_one_line(tmp_path):
    main = _script("project_levers").main
    np.save(tmp_path / "t.npy", _trace(tokens=8, layers=4, experts=256, k=6))
    write_trace(tmp_path / "r.npz", RoutingTrace(_trace(8, 4, 64, 6), np.full((8, 4, 6), 1 / 6, np.float32)))
    (tmp_path / "m.json").write_text(json.dumps({"margins": {}}))
    files = [
        (flag, str(tmp_path / name))
        for flag, name in (("--trace", "t.npy"), ("--recorded", "r.npz"), ("--margins", "m.json"))
    ]
    args = [*(x for pair in files for x in pair), "--efficiency", "0.7"]
    r = CliRunner().invoke(main, [*args, "--family", "v4", "--machines", "16g", "--experts-per-token", "5"])
    assert r.exit_code == 2 and "route by a table" in r.output and "Traceback" not in r.output
