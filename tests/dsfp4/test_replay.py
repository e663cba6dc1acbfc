"""The tier replay counts what the runtime would, Belady is the optimum, and the synthetic traces behave."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dsfp4.errors import ConfigError
from dsfp4.layout.routing_trace import read_trace
from dsfp4.projection.replay import belady, compare, replay, table


def _trace(*rows: list[list[int]]) -> np.ndarray:
    """Tokens given as [layers][k] lists -> [tokens, layers, k]."""
    return np.array(rows, dtype=np.int64)


def _brute_force_hits(steps: list[set], capacity: int) -> int:
    """Most hits any demand-filled cache of `capacity` gets on `steps` (exhaustive; tiny cases only)."""
    best = {frozenset(): 0}
    for need in steps:
        nxt: dict[frozenset, int] = {}
        for cache, hits in best.items():
            others = sorted(cache - need)
            keep = min(capacity - len(need), len(others))
            for kept in itertools.combinations(others, keep):
                state = frozenset(need | set(kept))
                nxt[state] = max(nxt.get(state, -1), hits + len(cache & need))
        best = nxt
    return max(best.values())


CYCLE = _trace(*[[[e]] for e in [0, 1, 2] * 3])  # one layer, top-1: 0 1 2 0 1 2 0 1 2


def test_lru_thrashes_on_a_cycle_where_belady_does_not():
    lru = replay(CYCLE, gpu_slots=2, ram_slots=3, policy="lru")
    assert (lru.accesses, lru.gpu_hits, lru.ram_hits, lru.ssd_reads) == (9, 0, 6, 3)
    opt = belady(CYCLE, gpu_slots=2, ram_slots=3)
    assert (opt.accesses, opt.gpu_hits, opt.ram_hits, opt.ssd_reads) == (9, 3, 3, 3)
    assert opt.gpu_rate == pytest.approx(1 / 3) and opt.ssd_rate == pytest.approx(1 / 3)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_room_for_every_key_means_only_first_uses_miss(policy, per_layer):
    rng = np.random.default_rng(1)
    trace = np.stack([rng.permutation(6)[:3] for _ in range(40)]).reshape(20, 2, 3)  # [tokens, layers, k]
    distinct = len({(layer, e) for layer in range(2) for e in trace[:, layer].ravel()})
    for hits in (replay(trace, 12, 12, policy, per_layer), belady(trace, 12, 12, per_layer)):
        assert (hits.accesses, hits.gpu_hits, hits.ram_hits, hits.ssd_reads) == (120, 120 - distinct, 0, distinct)


def test_per_layer_pools_differ_from_a_shared_pool():
    # Layer 0 cycles over 3 experts, layer 1 always uses expert 0: 4 keys in all.
    trace = _trace(*[[[e], [0]] for e in [0, 1, 2] * 2])
    shared = replay(trace, gpu_slots=4, ram_slots=6, policy="lru")
    assert (shared.gpu_hits, shared.ram_hits, shared.ssd_reads) == (8, 0, 4)
    split = replay(trace, gpu_slots=4, ram_slots=6, policy="lru", per_layer=True)  # 2 GPU, 3 RAM per layer
    assert (split.gpu_hits, split.ram_hits, split.ssd_reads) == (5, 3, 4)
    assert belady(trace, 4, 6, per_layer=True).gpu_hits == 7  # layer 0: 2 of its 3 re-uses, layer 1: 5


def test_repeated_ids_in_a_step_count_once():
    trace = _trace([[3, 3]], [[3, 4]])
    for hits in (replay(trace, 2, 2, "lru"), belady(trace, 2, 2)):
        assert (hits.accesses, hits.gpu_hits, hits.ssd_reads) == (3, 1, 2)


@pytest.mark.parametrize("seed", range(6))
def test_belady_matches_exhaustive_search(seed):
    rng = np.random.default_rng(seed)
    trace = np.stack([rng.choice(6, 2, replace=False) for _ in range(10)])[:, None, :]  # [10, 1, 2]
    steps = [set(row.tolist()) for row in trace[:, 0]]
    for cap in (2, 3, 4):
        assert belady(trace, cap, cap).gpu_hits == _brute_force_hits(steps, cap)


@pytest.mark.parametrize("seed", range(8))
def test_belady_bounds_every_policy_on_both_tiers(seed):
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, 13) ** 0.8
    trace = np.stack([rng.choice(12, 3, replace=False, p=popularity / popularity.sum()) for _ in range(4 * 60)])
    trace = trace.reshape(60, 4, 3)  # [tokens, layers, k]
    for (g, r), per_layer, policy in itertools.product([(12, 24), (16, 40), (20, 20)], [False, True], ["lru", "lfu"]):
        got, opt = replay(trace, g, r, policy, per_layer), belady(trace, g, r, per_layer)
        assert got.accesses == opt.accesses == got.gpu_hits + got.ram_hits + got.ssd_reads
        assert opt.gpu_hits >= got.gpu_hits, (g, r, per_layer, policy)
        assert opt.gpu_hits + opt.ram_hits >= got.gpu_hits + got.ram_hits, (g, r, per_layer, policy)


def test_ram_smaller_than_gpu_credits_nothing_to_ram():
    opt = belady(CYCLE, gpu_slots=3, ram_slots=2)
    assert (opt.gpu_hits, opt.ram_hits, opt.ssd_reads) == (6, 0, 3)


def test_capacity_below_top_k_is_an_error():
    trace = _trace([[0, 1, 2], [0, 1, 2]])  # 2 layers, top-3
    with pytest.raises(ValueError, match="GPU tier: 2 slots, fewer than the 3 experts"):
        replay(trace, 2, 8)
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        replay(trace, 3, 3, "mru")
    with pytest.raises(ValueError, match="RAM tier"):
        belady(trace, 3, 2)
    with pytest.raises(ValueError, match=r"5 slots // 2 layers = 2 per layer"):
        replay(trace, 5, 8, per_layer=True)
    rows = compare(trace, 5, 8)
    assert [(r.policy, r.mode) for r in rows] == [("lru", "global"), ("lfu", "global"), ("belady", "global")] + [
        ("-", "per-layer")
    ]
    assert "n/a: GPU tier" in table(rows)


def test_load_trace_round_trip_and_errors(tmp_path):
    good = tmp_path / "good.npy"
    np.save(good, np.arange(24, dtype=np.int16).reshape(2, 3, 4))
    assert read_trace(good).ids.shape == (2, 3, 4)
    cases = {
        "flat.npy": np.arange(8),
        "float.npy": np.zeros((2, 3, 4), dtype=np.float32),
        "negative.npy": -np.ones((2, 3, 4), dtype=np.int32),
        "empty.npy": np.zeros((0, 3, 4), dtype=np.int32),
    }
    for name, data in cases.items():
        np.save(tmp_path / name, data)
        with pytest.raises(ConfigError, match=name):
            read_trace(tmp_path / name)
    (tmp_path / "junk.npy").write_text("not numpy")
    for name in ("junk.npy", "missing.npy"):
        with pytest.raises(ConfigError, match=name):
            read_trace(tmp_path / name)


def test_compare_and_table_cover_policies_modes_and_belady():
    rng = np.random.default_rng(0)
    trace = np.stack([rng.choice(8, 2, replace=False) for _ in range(60)]).reshape(30, 2, 2)
    rows = compare(trace, 6, 10)
    assert [(r.policy, r.mode) for r in rows] == [
        (p, m) for m in ("global", "per-layer") for p in ("lru", "lfu", "belady")
    ]
    text = table(rows)
    assert "GPU hit %" in text and "Belady RAM %" in text and text.count("\n") == len(rows) + 1
