"""DeepSeek-V4 decode steps at a DevicePosition, the step a CUDA graph replays (runtime/generate/decode_graph.py): the
window ring, the compressors' slots and entries, the indexer and RoPE read the position from a tensor.

On the CPU the same code runs without capture: token by token at device positions it gives the logits of host
positions and of transformers, over 100 tokens (the 8-token window wraps 12 times, 25 CSA and 12 HCA windows
complete, the cache's 100 rows are no multiple of HCA's 8), mixed with eager chunks as the engine mixes prefill
and replayed steps, and a step the caller discards (a replay launched ahead of the host) is redone in place.
On CUDA (marked gpu) an engine decodes by graph replay with the greedy tokens of eager steps.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from dsfp4.kernels.linear import QuantizedWeight
from dsfp4.layout.quant import quantize
from dsfp4.runtime.generate.decode_graph import DecodeGraphs
from dsfp4.runtime.models.load import load_model
from dsfp4.runtime.models.position import DevicePosition
from dsfp4.runtime.models.v4.attention import grouped_output
from dsfp4.runtime.models.v4.model import TransformerV4
from dsfp4.synthetic.shapes import V4_TINY
from tests.fixtures.v4_checkpoint import build_v4_checkpoint, hf_model

TOL = 1e-5  # as tests/test_model_v4.py: fp32 against transformers
LONG = 100  # tokens, and the cache's rows: HCA's last window (96..103) never completes inside it
LEAST_SPAN = 16  # DecodeGraphs.span's MIN_SPAN, scaled to the tiny model: the steps cross spans 16, 32, 64, 100
VOCAB = V4_TINY["vocab_size"]


@pytest.fixture(scope="module")
def reference(v4_converted):
    """(tokens [1, LONG], transformers' logits [1, LONG, V])."""
    torch.manual_seed(0)
    tokens = torch.randint(2, VOCAB, (1, LONG))
    with torch.no_grad():
        return tokens, hf_model(v4_converted)(tokens).logits


@pytest.fixture(scope="module")
def model(v4_converted) -> TransformerV4:
    m = load_model(v4_converted, torch.device("cpu"), torch.float32, LONG)
    assert isinstance(m, TransformerV4)
    yield m
    m.experts.close()


def _span(pos: int) -> int:
    """As DecodeGraphs.span: the smallest power of two above pos, within the context."""
    return min(max(LEAST_SPAN, 1 << pos.bit_length()), LONG)


def _steps(model: TransformerV4, tokens: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens start .. end - 1 one at a time at device positions -> logits [1, n, V]; the model's position is
    moved after each, as DecodeGraphs._replay does."""
    out = []
    with torch.no_grad():
        for p in range(start, end):
            where = DevicePosition(torch.tensor([p]), _span(p))
            out.append(model(tokens[:, p : p + 1], where)[0])
            model.pos = p + 1
    return torch.cat(out, dim=1)


def _chunk(model: TransformerV4, tokens: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens start .. end - 1 in one pass at host positions -> logits [1, n, V]."""
    with torch.no_grad():
        return model(tokens[:, start:end], start)[0]


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.slow
def test_device_steps_give_the_logits_of_host_positions_and_transformers(model, reference):
    tokens, expected = reference
    host = _chunk(model, tokens, 0, LONG)
    device = _steps(model, tokens, 0, LONG)
    assert _gap(host, expected) <= TOL and _gap(device, expected) <= TOL
    assert _gap(device, host) <= TOL


def test_prefill_device_steps_and_eager_chunks_agree_with_one_pass(model, reference):
    """The eager path and the device path share the caches' layout: each continues where the other stopped,
    inside windows and across them (chunks of 13, 25, 23 cross the 8-token ring, CSA's 4 and HCA's 8)."""
    tokens, expected = reference
    parts = [
        _chunk(model, tokens, 0, 13),
        _steps(model, tokens, 13, 38),
        _chunk(model, tokens, 38, 61),
        _steps(model, tokens, 61, 67),
        _chunk(model, tokens, 67, 68),  # a 1-token eager step between replayed ones
        _steps(model, tokens, 68, 90),
        _chunk(model, tokens, 90, LONG),
    ]
    assert _gap(torch.cat(parts, dim=1), expected) <= TOL


@pytest.mark.parametrize("device_step", [True, False])
def test_a_discarded_step_is_redone_in_place(model, reference, device_step):
    """A replay launched for a token the caller then stops at leaves the caches one position past the
    caller's tokens: reusable() keeps them, and the next call redoes that position. At 23 the wrong token
    completes a CSA and an HCA window, at 43 a CSA window; it leaves a trace that the redo takes away."""
    tokens, expected = reference
    wrong = (tokens + 1) % VOCAB
    run = _steps if device_step else _chunk
    _chunk(model, tokens, 0, 23)
    run(model, wrong, 23, 24)
    assert model.pos == 24 and model.reusable(23) == 23 and model.reusable(22) == 0
    assert _gap(_chunk(model, tokens, 24, 30), expected[:, 24:30]) > 100 * TOL  # not redone: off
    _chunk(model, tokens, 0, 23)
    run(model, wrong, 23, 24)
    redone = [run(model, tokens, 23, 43)]  # from the position before the caches' end
    run(model, wrong, 43, 44)
    redone.append(_steps(model, tokens, 43, 50))
    assert _gap(torch.cat(redone, dim=1), expected[:, 23:50]) <= TOL


def test_decode_graphs_take_v4_and_count_every_layer(model):
    """V4 no longer refuses graphs; on the CPU the device does. Every V4 layer routes experts, hash layers too."""
    assert model.why_eager is None
    graphs = DecodeGraphs(model, LONG, torch.device("cpu"), recording=False)
    assert graphs.why_eager == "CUDA graphs need a CUDA device" and not graphs.ready
    assert graphs.moe_layers == list(range(model.args.n_layers))


# -- on CUDA ----------------------------------------------------------------------------------------------

CONTEXT = 640  # spans 256, 512 and 640
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.fixture(scope="module")
def v4_long(tmp_path_factory):
    """The tiny V4 model (transformers' weights, converted) with positions up to 1024, so the context holds 640."""
    root = tmp_path_factory.mktemp("v4long")
    checkpoint = build_v4_checkpoint(root / "hf", {**V4_TINY, "max_position_embeddings": 1024})
    convert(checkpoint, root / "model", ConvertOptions(), progress=False)
    return root / "model"


def _engines(path):
    from dsfp4.runtime.engine import Engine
    from dsfp4.runtime.options import RunOptions

    for graph in (True, False):
        options = RunOptions(device="cuda", max_context=CONTEXT, dtype="fp32", cuda_graph=graph)
        with Engine(path, options) as engine:
            assert engine.model.experts.all_resident
            assert engine.decode_mode == ("CUDA graph" if graph else "eager: --no-cuda-graph")
            yield graph, engine


@pytest.mark.gpu
def test_on_cuda_v4_decodes_by_graph_replay_with_the_tokens_of_eager_steps(v4_long):
    """Greedy tokens of replayed steps equal eager steps' past position 256 (two spans of entries)."""
    runs = {graph: engine.generate(PROMPT, max_tokens=300, temperature=0) for graph, engine in _engines(v4_long)}
    assert runs[True].stats.decode_mode == "CUDA graph"
    assert len(PROMPT) + len(runs[True].token_ids) > 256, "an EOS came first: the second span went untested"
    assert runs[True].token_ids == runs[False].token_ids


@pytest.mark.gpu
def test_on_cuda_a_turn_after_a_stopped_stream_reuses_the_cache(v4_long):
    """A stream the caller stops leaves a replayed step for its last token (launched before the host read it):
    the next turn keeps every cached token and redoes that position, with eager steps' tokens."""
    turns = {}
    for graph, engine in _engines(v4_long):
        stream = engine.stream(PROMPT, max_tokens=100, temperature=0)
        first = [d.token_id for d in itertools.islice(stream, 40)]  # then stop reading
        cached = list(engine.cached)
        again = engine.generate(cached + [20, 21], max_tokens=60, temperature=0)
        assert engine.stats.cached_tokens == len(cached) == len(PROMPT) + 39
        turns[graph] = (first, again.token_ids)
    assert turns[True] == turns[False]


@pytest.mark.parametrize("tokens", [1, 3])
def test_grouped_output_by_one_gemv_over_stored_bytes_equals_the_dequantized_groups(tokens):
    """Decode's grouped output projection (one GEMV over every group's rows, the diagonal blocks kept) gives
    each group its own block's product, as the dequantized einsum of prefill does."""
    g, o, k = 4, 256, 384
    w = torch.randn(g * o, k, generator=torch.Generator().manual_seed(0)) * 0.05
    wo_a = QuantizedWeight("fp8_e4m3_b128", quantize("fp8_e4m3_b128", w), (g * o, k))
    x = torch.randn(2, tokens, g, k, generator=torch.Generator().manual_seed(1))
    fused, plain = grouped_output(x, wo_a, stored=True), grouped_output(x, wo_a, stored=False)
    assert fused.shape == plain.shape == (2, tokens, g, o)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    blocks = wo_a.dequantize(torch.float32).view(g, o, k)
    torch.testing.assert_close(fused[1, -1, 2], blocks[2] @ x[1, -1, 2], rtol=1e-5, atol=1e-5)
