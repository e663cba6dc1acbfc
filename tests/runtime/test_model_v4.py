"""The DeepSeek-V4 runtime against transformers' DeepseekV4ForCausalLM on the same (dequantized) weights.

Tolerance: max |logit difference| <= 1e-5 in float32 (measured about 3e-7, logits up to about 0.8), for the
whole sequence at once, token by token, and in chunks after position 0. The tiny model has all three
attention kinds, two hash layers, 8 indexer heads picking 3 of up to 10 entries, and a SwiGLU limit its
activations reach, so each of these shows in the logits (checked below).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsfp4.runtime.models.load import load_model
from dsfp4.runtime.models.moe import HashGate
from dsfp4.runtime.models.v4.model import TransformerV4
from tests.fixtures.v4_checkpoint import hf_model

TOL = 1e-5
T = 40  # past the window (8), 10 CSA entries (ratio 4), 5 HCA entries (ratio 8)


@pytest.fixture(scope="module")
def setup(v4_converted):
    torch.manual_seed(0)
    tokens = torch.randint(2, 640, (1, T))
    with torch.no_grad():
        expected = hf_model(v4_converted)(tokens).logits
    model = load_model(v4_converted, torch.device("cpu"), torch.float32, 128)
    return model, tokens, expected


def _chunks(model: TransformerV4, tokens: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    out, pos = [], 0
    with torch.no_grad():
        for n in sizes:
            out.append(model(tokens[:, pos : pos + n], pos)[0])
            pos += n
    return torch.cat(out, dim=1)


@pytest.mark.slow
def test_full_token_by_token_and_chunked_match_transformers(setup):
    model, tokens, expected = setup
    assert isinstance(model, TransformerV4)
    full = _chunks(model, tokens, [T])
    assert (full - expected).abs().max() <= TOL
    one_by_one = _chunks(model, tokens, [1] * T)
    assert (one_by_one - expected).abs().max() <= TOL
    # chunks that start inside windows, across window and compression boundaries, after position 0
    chunked = _chunks(model, tokens, [5, 1, 9, 3, 14, 8])
    assert (chunked - expected).abs().max() <= TOL


def test_the_caches_resume_only_where_they_stopped(setup):
    """Where the last call stopped, or one before (a step writes only slots its redo rewrites)."""
    model, tokens, _ = setup
    _chunks(model, tokens, [T])
    assert model.reusable(T) == T and model.reusable(T - 1) == T - 1
    assert model.reusable(T - 2) == 0 and model.reusable(0) == 0


def test_hash_layers_route_by_the_token_table(setup):
    model, tokens, _ = setup
    gates = [b.ffn.gate for b in model.layers]
    assert [isinstance(g, HashGate) for g in gates] == [True, True, False, False, False]
    seen = {}
    for b in model.layers[:2]:
        b.ffn.observe = lambda layer, w, ids: seen.setdefault(layer, ids)
    try:
        _chunks(model, tokens, [T])
    finally:
        for b in model.layers[:2]:
            b.ffn.observe = None
    assert torch.equal(seen[0], gates[0].tid2eid[tokens[0]]) and torch.equal(seen[1], gates[1].tid2eid[tokens[0]])


def test_the_clamp_and_the_indexer_show_in_the_logits(setup):
    """The comparison above would miss neither a dropped SwiGLU clamp nor an indexer that kept everything."""
    model, tokens, expected = setup
    kernel, limit = model.moe_kernel, model.moe_kernel.limit
    try:
        kernel.limit = 0.0
        assert (_chunks(model, tokens, [T]) - expected).abs().max() > 100 * TOL
    finally:
        kernel.limit = limit
    indexers = [b.attn.indexer for b in model.layers if b.attn.indexer is not None]
    try:
        for ix in indexers:
            ix.topk = T
        assert (_chunks(model, tokens, [T]) - expected).abs().max() > 100 * TOL
    finally:
        for ix in indexers:
            ix.topk = model.args.index_topk


def test_engine_chat_turns_reuse_the_cache_only_where_it_stopped(v4_converted):
    from dsfp4.runtime.engine import Engine

    with Engine(v4_converted, device="cpu", max_context=128, max_tokens=4, temperature=0) as engine:
        first = engine.generate([5, 6, 7, 8, 9, 10, 11, 12, 13])
        cached = list(engine.cached)
        again = engine.generate(cached + [20, 21])  # a turn after everything cached: reused
        assert engine.stats.cached_tokens == len(cached)
        fresh = engine.generate([5, 6, 7, 8, 20, 21])  # a shorter shared prefix: recomputed from position 0
        assert engine.stats.cached_tokens == 0
        assert first.token_ids and again.token_ids and fresh.token_ids
        logits = engine.logits(cached + [20, 21])
    with Engine(v4_converted, device="cpu", max_context=128, max_tokens=4, temperature=0) as other:
        assert torch.allclose(other.logits(cached + [20, 21]), logits, atol=TOL)
        assert other.generate(cached + [20, 21]).token_ids == again.token_ids


def test_a_pass_stopped_inside_the_layers_starts_the_next_turn_over(v4_converted):
    """Ctrl-C in the chat can stop a pass after some layers advanced their caches and before the others did:
    the next turn prefills from position 0 instead of continuing where the layers disagree."""
    from dsfp4.runtime.engine import Engine

    with Engine(v4_converted, device="cpu", max_context=128, max_tokens=4, temperature=0) as engine:
        engine.generate([5, 6, 7, 8, 9, 10, 11])
        cached, block = list(engine.cached), engine.model.layers[3]

        def interrupt(*args, **kwargs):
            del block.forward  # once: the next pass runs the block again
            raise KeyboardInterrupt

        block.forward = interrupt
        with pytest.raises(KeyboardInterrupt):
            engine.generate(cached + [20, 21])
        again = engine.generate(cached + [20, 21, 22])
        assert engine.stats.cached_tokens == 0
    with Engine(v4_converted, device="cpu", max_context=128, max_tokens=4, temperature=0) as other:
        assert other.generate(cached + [20, 21, 22]).token_ids == again.token_ids


def test_mtp_block_runs_in_full_and_in_chunks(v4_converted):
    """transformers has no MTP block: its logits are checked for shape and for agreeing with themselves when fed
    in chunks (the block's own window cache continues like the main layers')."""
    model = load_model(v4_converted, torch.device("cpu"), torch.float32, 128, with_mtp=True)
    torch.manual_seed(1)
    tokens = torch.randint(2, 640, (1, 20))
    with torch.no_grad():
        streams = model.streams(tokens, 0)  # [1, 20, N, D]
        full = model.mtp[0](streams[:, :-1], tokens[:, 1:], 0)
        parts = [model.mtp[0](streams[:, a:b], tokens[:, a + 1 : b + 1], a) for a, b in ((0, 7), (7, 8), (8, 19))]
    assert full.shape == (1, 19, 640) and torch.isfinite(full).all()
    assert (torch.cat(parts, dim=1) - full).abs().max() <= TOL


@pytest.mark.gpu
@pytest.mark.parametrize(("gpu_slots", "chunk"), [(None, 512), (3, 8)])  # resident, prefill kernel; mapped, decode
def test_on_cuda_the_fp4_kernels_give_transformers_logits(setup, v4_converted, gpu_slots, chunk):
    """The Triton MoE kernels (MXFP4 records, the SwiGLU clamp) in fp32 on CUDA, with every record on the
    device or 3 there and the rest read from RAM in place (zero-copy), against transformers on the CPU."""
    from dsfp4.runtime.engine import Engine
    from dsfp4.runtime.models.load import plan_engine
    from dsfp4.runtime.options import RunOptions

    _, tokens, expected = setup
    options = RunOptions(device="cuda", dtype="fp32", max_context=128, prefill_chunk=chunk)
    plan = plan_engine(v4_converted, options)
    plan = dataclasses.replace(plan, gpu_slots=gpu_slots) if gpu_slots else plan
    with Engine(v4_converted, options, plan=plan) as engine:
        assert engine.model.moe_kernel.triton and engine.model.experts.mapped == (gpu_slots is not None)
        got = engine.logits(tokens[0].tolist())  # [T, V]
        assert engine.decode_mode.startswith("CUDA graph")  # every record reached without the host
    assert (got - expected[0]).abs().max() <= 1e-4
