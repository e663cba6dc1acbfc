"""Modes (runtime/modes.py): what each sets, that a lever given wins over its mode's, the flag and --plan's report;
the levers projected on the whole model (projection/levers.py) and the router's margins they take
(scripts/router_margins.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dsfp4.errors import ConfigError
from dsfp4.layout.recipe import ColdRecipe
from dsfp4.projection.levers import low_share, margin_shares, project_levers, skippable
from dsfp4.runtime.modes import EXACT, MODES, Levers
from dsfp4.runtime.options import RunOptions, with_knobs
from tests.dsfp4.test_simulate import _trace
from tests.fixtures.cli import run_cli
from tests.runtime.test_expert_store import _engine, _generate


def test_exact_is_the_default_and_a_lever_given_wins_over_the_modes():
    assert RunOptions().levers() == EXACT == Levers(0.0, 0.0)
    assert RunOptions(mode="throughput").levers() == MODES["throughput"]
    assert RunOptions(mode="throughput", cache_aware=0.0).levers() == Levers(MODES["throughput"].expert_threshold, 0.0)
    assert RunOptions(expert_threshold=0.2).levers() == Levers(0.2, 0.0)
    # the Python API and the server change a mode as any knob; the levers follow it
    assert with_knobs(RunOptions(), {"mode": "balanced"}).levers() == MODES["balanced"]
    with pytest.raises(ConfigError, match="--mode fast"):
        RunOptions(mode="fast")


def test_every_lossy_mode_sets_a_lever_and_they_rise_in_order():
    order = [MODES[m] for m in ("latency", "balanced", "throughput")]
    assert all(m != EXACT for m in order)
    for lower, higher in zip(order, order[1:], strict=False):
        assert lower.expert_threshold <= higher.expert_threshold and lower.cache_aware <= higher.cache_aware


@pytest.mark.parametrize(
    "knobs,counter",
    [({"expert_threshold": 0.45}, "skipped"), ({"cache_aware": 10.0}, "swapped"), ({"mode": "throughput"}, "skipped")],
)
def test_levers_off_or_nothing_cold_give_the_tokens_of_exact_routing(converted, knobs, counter):
    exact = _generate(_engine(converted))  # everything resident
    assert _generate(_engine(converted, **knobs)).token_ids == exact.token_ids  # nothing is cold: nothing changes
    off = {k: 0.0 for k in knobs if k != "mode"} or {"mode": "exact"}
    g = _generate(_engine(converted, 2, 2, **off))  # records streamed, every lever off
    assert g.token_ids == exact.token_ids and not g.stats.store[counter]


def test_plan_reports_the_levers_a_mode_chose(converted):
    r = run_cli("run", converted, "--plan", "--mode", "balanced", "--device", "cpu")
    assert r.exit_code == 0, r.output
    b = MODES["balanced"]
    assert f"mode balanced: expert threshold {b.expert_threshold:g}, cache-aware margin {b.cache_aware:g}" in r.output
    r = run_cli("run", converted, "--plan", "--json", "--mode", "balanced", "--cache-aware", "0", "--device", "cpu")
    assert json.loads(r.stdout)["levers"] == {
        "mode": "balanced",
        "expert_threshold": b.expert_threshold,
        "cache_aware": 0,
        "adaptive": False,
        "hide_ratio": None,
        "experts_per_token": 2,  # the model's own (--experts-per-token 0)
    }
    r = run_cli("run", converted, "--prompt", "hi", "--mode", "fast")
    assert r.exit_code == 2 and "--mode" in r.output


def test_low_share_counts_non_best_choices_below_the_threshold():
    weights = np.array([[[0.6, 0.3, 0.1]], [[0.5, 0.45, 0.05]]])  # [N, L, K]
    assert low_share(weights, 0.2) == pytest.approx(2 / 4)
    assert low_share(weights, 0.01) == 0.0
    mask = skippable((400, 3, 4), 0.5, seed=0)
    assert not mask[..., 0].any() and 0.4 < mask[..., 1:].mean() < 0.6
    assert skippable((4, 3, 4), 0.0, seed=0) is None


def test_margin_shares_counts_unchosen_neighbours_of_the_same_group():
    choice = np.array([[0.9, 0.85, 0.2, 0.1, 0.5, 0.48, 0.4, 0.0]])  # 2 groups of 4
    ids = np.array([[0, 4]])
    got = margin_shares(choice, ids, groups=2, margins=[0.03, 0.06])
    # unchosen pairs: 0 with 1, 2, 3 (gaps 0.05, 0.7, 0.8); 4 with 5, 6, 7 (0.02, 0.1, 0.5)
    assert got["0.03"] == {"close": pytest.approx(1 / 6), "any": 0.5}
    assert got["0.06"] == {"close": pytest.approx(2 / 6), "any": 1.0}


@pytest.mark.slow
def test_project_levers_exact_is_the_exact_projection_and_levers_read_less():
    from dsfp4.projection.whole_model import project

    ids = _trace(tokens=60, layers=8, experts=256, k=8)
    weights = np.random.default_rng(1).random((100, 4, 8))
    modes = {"exact": EXACT, "lossy": Levers(0.2, 0.05)}
    exact, lossy = project_levers("v3", ids, ["16g"], 0.7, modes, weights, {0.05: 0.5}, recall=0.9)
    (reference,) = project("v3", ids, ["16g"], eff=0.7, variants=(("hot", 0.9, False),))
    assert exact.projection == reference.projection
    assert lossy.projection.ssd_bytes < exact.projection.ssd_bytes and lossy.projection.swapped > 0
    assert lossy.to_dict()["skipped_share"] > 0
    recipe = ColdRecipe.parse("gate=2,up=2,down=3")
    rows = project_levers("v3", ids, ["16g"], 0.7, {"exact": EXACT}, weights, {}, cold_bits=(2, recipe), hot_share=0.1)
    two, mixed = (row.to_dict() for row in rows)
    assert mixed["cold_bits"] == "gate=2,up=2,down=3" and two["routed_bits"] < mixed["routed_bits"] < 4.5
    assert two["ssd_gb_per_token"] < mixed["ssd_gb_per_token"]
