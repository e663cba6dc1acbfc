"""A prompt fed layer by layer where experts stream (runtime/generate/decoder.py, layer_pass.py): every chunk through a
block before the next block, the block's feed-forward over groups of chunks, the logits and greedy tokens of one
whole-prompt chunk, each layer's records brought once per group and read once for the prompt, and a chunk's attention
reading the rows its earlier chunks wrote."""

from __future__ import annotations

import pytest
import torch

from dsfp4.kernels.moe import waves
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.layer_pass import chunked, grouped, trace_rows
from tests.runtime.test_expert_store import _engine

# long enough for several chunks of CHUNK
PROMPT = "Explain the tiers of the expert store, layer by layer"
CHUNK = 4
# a chunk the prefill kernel takes, past decode's tokens
PREFILL_CHUNK = 20


def _layers_asked(engine: Engine) -> list[int]:
    """The MoE layers whose experts the store is asked for, in order (the store's load_waves, patched)."""
    store, asked = engine.model.experts, []
    real = store.load_waves

    def load_waves(layer, experts, *rest, **named):
        asked.append(layer)
        return real(layer, experts, *rest, **named)

    store.load_waves = load_waves
    return asked


@pytest.mark.parametrize(("group", "attend"), [(0, 0), (2 * CHUNK + 1, CHUNK), (0, 3 * CHUNK)])
def test_a_streamed_prompt_goes_through_each_layer_for_all_its_chunks_with_the_logits_of_one_chunk(
    converted, group, attend
):
    """group 0: the plan's, which holds the whole prompt: each layer's experts asked for once; else several groups of
    two chunks (a group is whole chunks), each layer asked once per group. attend: the attention takes pieces of a chunk
    or of three, each reading the rows its earlier pieces wrote (0: the plan's, which holds the whole prompt)."""
    with Engine(converted, device="cpu", max_context=64) as whole:
        ids = whole.encode(PROMPT)
        expected = whole.logits(ids)  # one chunk: every record resident, through all blocks at once
        resident = whole.generate(ids, max_tokens=6, temperature=0).token_ids
    assert len(ids) > 5 * CHUNK
    with _engine(converted, 3, 5, prefill_chunk=CHUNK) as streamed:
        assert streamed.plan.prefill_group >= len(ids)
        if group:
            streamed.decoder.prefill_group = group
        if attend:
            streamed.decoder.attention_group = attend
        asked = _layers_asked(streamed)
        got = streamed.logits(ids)
        groups = 1 if not group else -(-len(ids) // (2 * CHUNK))
        moe = sorted(set(asked))
        assert len(moe) > 1 and asked == [layer for layer in moe for _ in range(groups)]  # layer by layer
        # a chunk whose attention missed its earlier chunks' rows would give other logits
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert streamed.generate(ids, max_tokens=6, temperature=0).token_ids == resident


@pytest.mark.parametrize("group", [0, 2 * PREFILL_CHUNK])
def test_chunks_past_decodes_tokens_take_compacted_waves_with_the_logits_and_tokens_of_one_chunk(
    converted, monkeypatch, group
):
    """Chunks the prefill kernel takes (more than decode's MAX_TOKENS): each wave computes only the pairs of the experts
    it brought (kernels/moe/waves.py, patched to count them), summed in fp32 in another order than the chunk's."""
    from dsfp4.runtime.models import moe

    pairs = []
    real = moe.add_wave
    monkeypatch.setattr(moe, "add_wave", lambda *a: pairs.append(a[6].pairs.size) or real(*a))
    with Engine(converted, device="cpu", max_context=64) as whole:
        ids = (whole.encode(PROMPT) * 3)[: 2 * PREFILL_CHUNK + 7]
        expected = whole.logits(ids)
        resident = whole.generate(ids, max_tokens=6, temperature=0).token_ids
    assert not pairs and waves.compacts(PREFILL_CHUNK, None)
    with _engine(converted, 3, 5, prefill_chunk=PREFILL_CHUNK) as streamed:
        assert streamed.plan.prefill_group >= len(ids)
        if group:
            streamed.decoder.prefill_group = group
        torch.testing.assert_close(streamed.logits(ids), expected, rtol=1e-4, atol=1e-4)
        assert pairs and min(pairs) > 0
        assert streamed.generate(ids, max_tokens=6, temperature=0).token_ids == resident


@pytest.mark.parametrize("group", [0, CHUNK])
def test_a_prompt_reads_each_layers_records_once_where_ram_holds_a_layer(converted, group):
    """RAM holds one layer's records, not two: chunk by chunk, every chunk would read the layers again. Grouped (the
    plan's group holds the prompt), each record comes to the device once; a chunk a group, once per chunk."""
    a = Manifest.read(converted).args
    records = sum(a.is_moe_layer(i) for i in range(a.n_layers)) * a.n_routed_experts  # the main layers' (no MTP)
    with _engine(converted, 3, a.n_routed_experts, prefill_chunk=CHUNK, io_threads=1) as streamed:
        if group:
            streamed.decoder.prefill_group = group
        ids = streamed.encode(PROMPT)
        g = streamed.generate(ids, max_tokens=1, temperature=0)
    s = g.stats.store
    # the chunks together use each layer's records several times
    assert (s["expert_uses"] > records) == bool(group)
    assert 0 < s["ssd_reads"] <= records


def test_deepseek_v4_fed_layer_by_layer_gives_the_logits_of_one_chunk_and_continues_a_turn(v4_converted):
    """V4's compressors and window ring run a state along the positions: each block takes the chunks in order, and the
    next turn continues where every block stopped."""
    torch.manual_seed(1)
    ids = torch.randint(2, 640, (21,)).tolist()
    with Engine(v4_converted, device="cpu", max_context=64) as whole:
        expected = whole.logits(ids[:9])
        answer = whole.generate(ids, max_tokens=3, temperature=0).token_ids
    with _engine(v4_converted, 3, 5, prefill_chunk=CHUNK) as streamed:
        asked = _layers_asked(streamed)
        torch.testing.assert_close(streamed.logits(ids[:9]), expected, rtol=1e-4, atol=1e-4)
        assert len(set(asked)) > 1 and asked == sorted(asked)  # layer by layer
        g = streamed.generate(ids, max_tokens=3, temperature=0)
    assert g.stats.cached_tokens == 9 and g.token_ids == answer  # 12 more tokens, layer by layer after the 9


def test_a_pass_chunks_each_sequence_and_groups_whole_chunks_across_sequences():
    pieces = chunked([5, 3], 2)
    assert [(p.seq, p.at, p.n) for p in pieces] == [(0, 0, 2), (0, 2, 2), (0, 4, 1), (1, 0, 2), (1, 2, 1)]
    assert [[p.n for p in g] for g in grouped(pieces, 4)] == [[2, 2], [1, 2, 1]]
    assert [[p.n for p in g] for g in grouped(pieces, 1)] == [[2], [2], [1], [2], [1]]  # a chunk alone when longer
    assert trace_rows(grouped(pieces, 4)[1], [100, 200]) == [104, 200, 201, 202]


def test_chunks_of_one_token_are_decode_steps_not_a_layer_wise_pass():
    """--prefill-chunk 1 feeds token by token through every block, as decode does, so that eval scores the levers
    where they act (a layer-wise pass brings every record a group uses, and then nothing is cold)."""
    from dsfp4.runtime.generate.decoder import by_layer

    assert by_layer(100, 4, visible=False) and not by_layer(100, 1, visible=False)
    assert not by_layer(100, 4, visible=True) and not by_layer(4, 4, visible=False)
