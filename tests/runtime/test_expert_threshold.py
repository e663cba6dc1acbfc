"""The expert threshold (RunOptions.expert_threshold): which choices a token leaves out, how the rest are weighted,
and that it changes nothing where no expert is cold or when it is 0."""

from __future__ import annotations

import json

import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.modes import Levers
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.lever_rules import kept_weights
from tests.fixtures.cli import run_cli
from tests.runtime.test_expert_store import CPU, _engine, _generate, _plan


def test_kept_weights_keep_each_tokens_sum_and_change_nothing_when_all_are_kept():
    w = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3]])
    keep = torch.tensor([[True, False, True], [True, True, True]])
    got = kept_weights(w, keep)
    assert torch.allclose(got.sum(-1), w.sum(-1)) and got[0, 1] == 0
    assert torch.allclose(got[0], torch.tensor([0.5, 0.0, 0.2]) / 0.7)
    assert torch.equal(got[1], w[1])  # bit for bit: exact routing where nothing is left out


def test_a_token_leaves_out_only_cold_experts_it_weighs_below_the_threshold_and_never_its_best(converted):
    manifest = Manifest.read(converted)
    layer = min(manifest.experts)
    store = ExpertStore(converted, manifest, CPU, _plan(converted, 3, 5), levers=Levers(expert_threshold=0.3))
    try:
        store.read_ahead([(layer, 1)], set())  # expert 1 in RAM: never cold
        store.sync()
        # token 0 chose 0 (its best), 2 (0.2 of its weight); token 1 chose 2 (0.4), 1 (in RAM); token 2 chose 3, 4
        ids, weights = [0, 2, 2, 1, 3, 4], [0.8, 0.2, 0.4, 0.6, 0.5, 0.5]
        skip, drop = store.rules.skip_cold(layer, ids, weights, 2)
        assert drop == [False, True, False, False, False, False] and skip == set()  # token 1 keeps expert 2
        skip, drop = store.rules.skip_cold(layer, [0, 2, 1, 2], [0.9, 0.1, 0.75, 0.25], 2)
        assert drop == [False, True, False, True] and skip == {2}  # cold, and both tokens weigh it below 0.3
        skip, drop = store.rules.skip_cold(layer, [1, 2], [0.1, 0.9], 2)
        assert drop == [False, False] and skip == set()  # a token's best stays, and so does RAM's expert
        assert store.counters.skipped == 1 and store.counters.skipped_bytes == manifest.record.nbytes
    finally:
        store.close()


def test_a_threshold_leaves_cold_experts_out_and_counts_them(converted):
    g = _generate(_engine(converted, 2, 1, io_threads=1, expert_threshold=0.49), n=16)
    s = g.stats.store
    assert s["skipped"] > 0 and s["skipped_bytes"] == s["skipped"] * Manifest.read(converted).record.nbytes
    assert 0 < g.stats.derived()["skipped_share"] < 1 and "left out by the threshold" in g.stats.line()


def test_the_threshold_flag_is_checked_and_eval_reports_what_it_left_out(converted, tmp_path):
    with pytest.raises(ConfigError, match="--expert-threshold 1.0"):
        RunOptions(expert_threshold=1.0)
    r = run_cli("run", converted, "--prompt", "hi", "--expert-threshold", "-0.1")
    assert r.exit_code == 2 and "--expert-threshold" in r.output
    text = tmp_path / "t.txt"
    text.write_text("the model reads expert weights from disk and computes tokens " * 8)
    r = run_cli("eval", converted, "--text", text, "--context", 16, "--json", "-q", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["skipped_share"] == 0.0  # everything resident: nothing is cold
    r = run_cli("eval", converted, "--text", text, "--context", 16, "--expert-threshold", 1, "-q", "--device", "cpu")
    assert r.exit_code == 2 and "--expert-threshold" in r.output


def captured_and_eager(converted, counter: str, ram_slots: int, **knobs) -> list[list[int]]:
    """Greedy tokens of a CUDA run through 2 device slots with CUDA graphs, then without, each from the store state
    capturing leaves (the eager run takes the same step of token 0 at position 0 first); `counter` must count."""
    import dataclasses

    from dsfp4.runtime.engine import Engine
    from dsfp4.runtime.models.load import plan_run

    tokens, manifest = [], Manifest.read(converted)
    for graphs in (True, False):
        options = RunOptions(device="cuda", max_context=64, cuda_graph=graphs, io_threads=1, **knobs)
        plan = plan_run(manifest, torch.device("cuda"), torch.bfloat16, 64, options, False)
        plan = dataclasses.replace(plan, gpu_slots=2, ram_slots=ram_slots, staging=1)
        with Engine(converted, options, plan=plan) as engine:
            if not graphs:  # one span is captured (max_context 64): one such step
                engine.logits([0])
                engine.reset()
            g = engine.generate([0, 5, 9, 11], max_tokens=16, temperature=0)
            assert g.stats.store[counter] > 0, g.stats.store
            assert engine.decode_mode.startswith("CUDA graph") == graphs, engine.decode_mode
            tokens.append(g.token_ids)
    return tokens


@pytest.mark.gpu
def test_on_cuda_graph_steps_leave_out_what_eager_steps_leave_out(converted):
    """Captured steps rescale by the offsets table (an expert left out has no slot); eager steps by the choices."""
    captured, eager = captured_and_eager(converted, "skipped", ram_slots=1, expert_threshold=0.49)
    assert captured == eager


@pytest.mark.parametrize("ratio,left_out", [(0.0, {2, 3, 4}), (0.5, {3, 4}), (1.0, {4}), (2.0, set())])
def test_auto_leaves_out_only_the_cold_reads_its_copies_cannot_hide(converted, ratio, left_out):
    """Experts 0 and 1 in RAM (two copies cross PCIe: they hide floor(ratio x 2) reads); 2, 3, 4 cold and each
    weighed below the cap by the one token that chose it (2 most, 4 least): the least weighed are left out."""
    manifest = Manifest.read(converted)
    layer = min(manifest.experts)
    levers = Levers(expert_threshold=0.3, adaptive=True, hide_ratio=ratio)
    store = ExpertStore(converted, manifest, CPU, _plan(converted, 3, 5), levers=levers)
    try:
        store.read_ahead([(layer, 0), (layer, 1)], set())
        store.sync()
        ids, weights = [0, 2, 1, 3, 0, 4], [0.75, 0.25, 0.8, 0.2, 0.85, 0.15]  # three tokens, two choices each
        skip, drop = store.rules.skip_cold(layer, ids, weights, 2)
        assert skip == left_out and drop == [e in left_out for e in ids]
        assert store.counters.skipped == len(left_out)
    finally:
        store.close()


def test_auto_is_a_flag_value_and_its_plan_says_so(converted):
    assert RunOptions(expert_threshold="auto").levers() == Levers(0.2, 0.0, adaptive=True)
    with pytest.raises(ConfigError, match="--expert-threshold fast: give auto"):
        RunOptions(expert_threshold="fast")
    r = run_cli("run", converted, "--plan", "--expert-threshold", "auto", "--device", "cpu")
    assert r.exit_code == 0 and "expert threshold auto (up to 0.2)" in r.output
    r = run_cli("run", converted, "--prompt", "hi", "--expert-threshold", "fast")
    assert r.exit_code == 2 and "give auto, or a weight" in r.output
    # on the CPU no copy hides a read (ratio 0): auto leaves out what its cap would
    auto = _generate(_engine(converted, 2, 1, io_threads=1, expert_threshold="auto"), n=8)
    cap = _generate(_engine(converted, 2, 1, io_threads=1, expert_threshold=0.2), n=8)
    assert auto.token_ids == cap.token_ids and auto.stats.store["skipped"] == cap.stats.store["skipped"]
