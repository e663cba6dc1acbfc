"""Cache-aware routing (RunOptions.cache_aware): which cold choices are swapped and for which warm expert, the weights
the new choice gets, and that it changes nothing where no expert is cold or when it is 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.kernels.router.route import chosen_weights
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.modes import Levers
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.cache_aware import Swap
from dsfp4.runtime.store.expert_store import ExpertStore
from dsfp4.runtime.store.lever_rules import swap_cold
from tests.fixtures.cli import run_cli
from tests.runtime.test_expert_store import CPU, _engine, _generate, _plan
from tests.runtime.test_expert_threshold import captured_and_eager

# 8 experts in 2 groups of 4; one token's scores, best first: 0 (0.9), 5 (0.8), 1 (0.7), 4 (0.6), 2 (0.5) ...
CHOICE = np.array([[0.9, 0.7, 0.5, 0.1, 0.6, 0.8, 0.2, 0.3]])


def _warm(*experts: int):
    return lambda e: e in experts


def test_a_cold_choice_takes_the_best_warm_unchosen_expert_of_its_group_within_the_margin():
    ids = np.array([[0, 5]])
    got, n = swap_cold(ids, CHOICE, _warm(5, 1, 2), groups=2, margin=0.5)
    assert got.tolist() == [[1, 5]] and n == 1  # 0 is cold: 1 (0.7) beats 2 (0.5); 5 is warm and stays
    assert ids.tolist() == [[0, 5]]  # pure
    got, n = swap_cold(ids, CHOICE, _warm(2, 4), groups=2, margin=0.25)
    assert got.tolist() == [[0, 4]] and n == 1  # 2 is 0.4 below 0; 4 is 0.2 below 5
    got, n = swap_cold(ids, CHOICE, _warm(6, 7), groups=2, margin=0.05)
    assert got.tolist() == [[0, 5]] and n == 0  # no warm expert scored close enough


def test_a_swap_stays_in_the_group_and_never_takes_an_expert_already_chosen():
    ids = np.array([[0, 1], [5, 4]])
    got, n = swap_cold(ids, np.repeat(CHOICE, 2, 0), _warm(1, 4, 6), groups=2, margin=1.0)
    assert got.tolist() == [[0, 1], [6, 4]] and n == 1  # 0's group holds no other warm one; 5 -> 6, not 4 again
    got, n = swap_cold(np.array([[3, 2]]), CHOICE, _warm(0), groups=2, margin=1.0)
    assert got.tolist() == [[0, 2]] and n == 1  # two cold choices, one warm expert: it is taken once
    got, n = swap_cold(np.array([[3, 2]]), CHOICE, _warm(5), groups=1, margin=1.0)
    assert got.tolist() == [[5, 2]] and n == 1  # without groups every expert is a candidate


def test_a_cold_expert_is_swapped_only_when_every_token_that_chose_it_can():
    choice = np.array([[0.9, 0.7, 0.5, 0.1, 0.6, 0.8, 0.2, 0.3], [0.9, 0.1, 0.5, 0.1, 0.6, 0.8, 0.2, 0.3]])
    ids = np.array([[0, 5], [0, 5]])
    got, n = swap_cold(ids, choice, _warm(1, 5), groups=2, margin=0.3)
    # token 0 could take 1 for cold 0, token 1 cannot (1 scores 0.1): 0 is read anyway, so neither swaps it
    assert got.tolist() == [[0, 5], [0, 5]] and n == 0
    got, n = swap_cold(ids, choice, _warm(1, 5), groups=2, margin=0.9)
    assert got.tolist() == [[1, 5], [1, 5]] and n == 2  # both can: 0 is not read at all


class _Store:
    def __init__(self, warm: set[int]):
        self.warm, self.swaps = warm, 0

    def is_warm(self, layer: int, expert: int) -> bool:
        return expert in self.warm

    def count_swaps(self, n: int) -> None:
        self.swaps += n


def test_a_swap_rewrites_the_kernels_choice_in_place_with_the_routers_weights_for_it():
    scores = torch.tensor(CHOICE, dtype=torch.float32)
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5])  # the selection ranks 7 (0.3 + 0.5) above 5
    ids = torch.tensor([[0, 7]])
    weights = chosen_weights(scores, ids, True, 2.5)
    swap = Swap(ids, weights, scores, bias, groups=2, norm=True, scale=2.5, margin=0.05)
    store = _Store({0, 5})
    assert swap.apply(store, 3, [0, 7]) == [0, 5] and store.swaps == 1  # 5 (0.8) is within 0.05 of 7 (0.8)
    assert ids.tolist() == [[0, 5]]
    assert torch.allclose(weights, torch.tensor([[0.9, 0.8]]) / 1.7 * 2.5)  # renormalized over the new pair
    assert swap.apply(_Store({0, 5}), 3, [0, 5]) == [0, 5]  # nothing cold: nothing read back, nothing changed


def test_cache_aware_swaps_cold_choices_for_warm_ones_and_counts_them(converted):
    manifest = Manifest.read(converted)
    g = _generate(_engine(converted, 2, 6, io_threads=1, cache_aware=10.0), n=16)
    assert g.stats.store["swapped"] > 0 and "swapped for warm experts" in g.stats.line()
    assert "cache-aware" in g.stats.table()
    store = ExpertStore(converted, manifest, CPU, _plan(converted, 3, 5), levers=Levers(cache_aware=1.0))
    try:
        assert not store.rules.is_warm(min(manifest.experts), 0)
    finally:
        store.close()


def test_the_cache_aware_flag_is_checked(converted):
    with pytest.raises(ConfigError, match="--cache-aware -1"):
        RunOptions(cache_aware=-1.0)
    r = run_cli("run", converted, "--prompt", "hi", "--cache-aware", "-0.1")
    assert r.exit_code == 2 and "--cache-aware" in r.output


@pytest.mark.gpu
def test_on_cuda_graph_steps_swap_what_eager_steps_swap(converted):
    """A captured step's next piece reads the indices and weights the host rewrote between the pieces."""
    captured, eager = captured_and_eager(converted, "swapped", ram_slots=6, cache_aware=10.0)
    assert captured == eager
