"""Routing from a trace (--routing): the MoE layers take a trace's experts token by token, so a trace recorded from
the model itself gives back its own tokens, another trace decides which experts run, and prefetch guesses come
from the trace at the stated recall."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.routing_trace import RoutingTrace, read_trace, write_trace
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.models.trace_routing import TraceRouting

PROMPT = "The expert store reads records from the SSD"


def test_a_trace_recorded_from_the_model_gives_back_its_tokens(converted, tmp_path):
    trace = tmp_path / "own.npz"
    with Engine(converted, device="cpu", max_context=128, record_trace=trace) as engine:
        plain = engine.generate(PROMPT, max_tokens=8, temperature=0)
    with Engine(converted, device="cpu", max_context=128, routing=trace) as engine:
        replayed = engine.generate(PROMPT, max_tokens=8, temperature=0)
    assert replayed.token_ids == plain.token_ids
    assert "own.npz" in replayed.stats.routing and "recall 0.90" in replayed.stats.routing
    assert "routing" in replayed.stats.table()


def test_the_trace_decides_which_experts_run(converted, tmp_path):
    with Engine(converted, device="cpu", max_context=128) as engine:
        a = engine.model.args
        layers = [b.ffn.layer for b in engine.model.layers if b.moe]
    ids = np.tile(np.array([5, 2], dtype=np.int32), (3, len(layers), 1))  # [tokens, layers, top_k], wraps around
    write_trace(tmp_path / "fixed.npy", RoutingTrace(ids))
    seen = tmp_path / "seen.npz"
    with Engine(converted, device="cpu", max_context=128, routing=tmp_path / "fixed.npy", record_trace=seen) as e:
        g = e.generate(PROMPT, max_tokens=4, temperature=0)
    recorded = read_trace(seen)
    assert (recorded.ids == np.array([5, 2])).all() and len(recorded.ids) == g.stats.prompt_tokens + 3
    np.testing.assert_allclose(recorded.weights, a.route_scale / a.n_activated_experts)  # no weights: equal


def test_trace_layers_spread_over_the_model_and_bad_traces_are_refused(tmp_path):
    ids = np.arange(10 * 6 * 2).reshape(10, 6, 2) % 8
    write_trace(tmp_path / "t.npy", RoutingTrace(ids))
    r = TraceRouting(tmp_path / "t.npy", [1, 2, 3], 8, 2, 2.5, torch.device("cpu"), 9)
    assert r.trace_layers == [0, 2, 4]
    r.begin(3)
    w, got = r.route(2, 3)
    assert got.tolist() == ids[:3, 2].tolist() and torch.allclose(w, torch.full((3, 2), 1.25))
    r.begin(9)  # wraps around the trace's end
    assert r.route(1, 1)[1].tolist() == ids[3:4, 0].tolist() and r.cursor == 2
    assert r.reserve(4) == 2 and r.cursor == 6  # a batched sequence's own stretch: rows 2..5
    r.begin_rows([2, 7, 13])  # each sequence its row; 13 wraps to 3
    assert r.route(3, 3)[1].tolist() == ids[[2, 7, 3], 4].tolist() and r.cursor == 6
    with pytest.raises(ConfigError, match="expert id 7, the model has 4"):
        TraceRouting(tmp_path / "t.npy", [1], 4, 2, 1.0, torch.device("cpu"), 4)
    with pytest.raises(ConfigError, match="2 experts per token, the model routes 3"):
        TraceRouting(tmp_path / "t.npy", [1], 8, 3, 1.0, torch.device("cpu"), 4)
    with pytest.raises(ConfigError, match="--routing .* no such file"):
        Engine(tmp_path, routing=tmp_path / "missing.npy")


@pytest.mark.parametrize("recall", [0.0, 0.5, 1.0])
def test_prefetch_guesses_keep_the_stated_share_of_the_next_layers_experts(tmp_path, recall):
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(64, 6, replace=False) for _ in range(4)]) for _ in range(400)])
    write_trace(tmp_path / "t.npy", RoutingTrace(ids))
    r = TraceRouting(tmp_path / "t.npy", [0, 1, 2, 3], 64, 6, 1.0, torch.device("cpu"), 400, recall=recall)
    r.begin(400)
    hit = []
    for layer in (1, 2, 3):
        guess, truth = r.guess(layer, 400), ids[:, layer]
        assert not (guess.sort(dim=1).values[:, 1:] == guess.sort(dim=1).values[:, :-1]).all()
        hit.append(np.mean([len(set(g) & set(t)) / 6 for g, t in zip(guess.tolist(), truth.tolist(), strict=True)]))
    assert abs(float(np.mean(hit)) - recall) < 0.03


@pytest.mark.gpu
def test_on_cuda_eager_steps_give_back_the_tokens_and_graphs_replay_under_the_trace(converted, tmp_path):
    """Recording forces eager steps, so the exact check is eager against eager; graph replays (their attention
    spans padded, another reduction order in bf16) run under the trace too."""
    trace = tmp_path / "own.npz"
    with Engine(converted, device="cuda", max_context=128, record_trace=trace) as engine:
        plain = engine.generate(PROMPT, max_tokens=12, temperature=0)
    with Engine(converted, device="cuda", max_context=128, routing=trace, cuda_graph=False) as engine:
        assert engine.generate(PROMPT, max_tokens=12, temperature=0).token_ids == plain.token_ids
    with Engine(converted, device="cuda", max_context=128, routing=trace) as engine:
        g = engine.generate(PROMPT, max_tokens=12, temperature=0)
        assert engine.decode_mode.startswith("CUDA graph") and len(g.token_ids) == 12 and g.stats.routing
