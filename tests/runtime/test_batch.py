"""Batched decoding (runtime/generate/batch.py): each sequence's greedy tokens equal decoding it alone, whatever else
is in the batch and whenever it joined; per-sequence budgets, stop strings and cancellation; the plan's caches for
the batch; refusals. On the GPU the same comparison runs the Triton kernels (-m gpu)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from dsfp4 import Engine
from dsfp4.errors import ConfigError
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.generate.batch import STEPPED_PROMPT_TOKENS
from dsfp4.runtime.models.load import plan_engine
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.plan.planner import auto_batch, cache_slots, expected_union, sequence_cache_bytes, union_batch

# prompts of different lengths, so that the batch's sequences sit at different positions; one more than the batch
# holds, so that the last joins when a slot frees
PROMPTS = [[5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5], [8] * 13, [2, 7, 1, 8, 2, 8]]
TOKENS = [6, 9, 4, 7]


def _alone(engine: Engine, ids: list[int], max_tokens: int) -> list[int]:
    engine.reset()
    return engine.generate(ids, max_tokens=max_tokens, temperature=0).token_ids


def _batched(engine: Engine, tokens: list[int] = TOKENS) -> dict[int, list[int]]:
    requests = [(ids, engine.options_for(max_tokens=n, temperature=0)) for ids, n in zip(PROMPTS, tokens, strict=True)]
    return {i: g.token_ids for i, g in engine.generate_batch(requests)}


def _check_batch_matches_alone(converted, device: str, dtype: str, graphs: bool = False) -> None:
    with Engine(converted, device=device, dtype=dtype, max_context=64, max_batch=3, cuda_graph=graphs) as engine:
        assert engine.plan.max_batch == 3
        alone = [_alone(engine, ids, n) for ids, n in zip(PROMPTS, TOKENS, strict=True)]
        requests = [
            (ids, engine.options_for(max_tokens=n, temperature=0)) for ids, n in zip(PROMPTS, TOKENS, strict=True)
        ]
        got = dict(engine.generate_batch(requests))
        assert [got[i].token_ids for i in range(len(PROMPTS))] == alone
        assert ("eager" not in got[0].stats.decode_mode) == graphs, got[0].stats.decode_mode
        assert engine.generate(PROMPTS[1], max_tokens=5, temperature=0).token_ids == alone[1][:5]  # slot 0 unharmed


def test_batched_greedy_tokens_equal_each_sequence_alone(converted):
    _check_batch_matches_alone(converted, "cpu", "fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
def test_batched_greedy_tokens_equal_each_sequence_alone_on_cuda(converted, graphs):
    """Eager steps, and steps replayed from graphs captured per batch size and span on their first use."""
    _check_batch_matches_alone(converted, "cuda", "fp32", graphs)


def test_each_sequence_keeps_its_own_budget_stop_strings_and_cancel(converted):
    with Engine(converted, device="cpu", max_context=64, max_batch=2) as engine:
        alone = engine.generate(PROMPTS[0], max_tokens=12, temperature=0)
        stop = alone.text[3:5] if len(alone.text) >= 5 else None
        run = engine.batch()
        cancel = threading.Event()
        a = run.add(PROMPTS[0], engine.options_for(max_tokens=12, temperature=0, stop=stop))
        b = run.add(PROMPTS[1], engine.options_for(max_tokens=30, temperature=0.8, seed=1), cancel)
        assert run.free == 0
        for step in range(40):
            if step == 4:
                cancel.set()
            run.step()
        assert run.rows == []
        assert b.generation.finish_reason == "cancelled" and len(b.generation.token_ids) <= 6
        ga = a.generation
        if stop is not None:
            assert ga.finish_reason == "stop" and stop not in ga.text and alone.text.startswith(ga.text)
        assert "".join(d.text for d in a.deltas) == ga.text
        assert ga.stats.generated_tokens >= 1 and "batch" in ga.stats.decode_mode


def test_sampled_sequences_follow_their_seed_whatever_the_batch(converted):
    with Engine(converted, device="cpu", max_context=64, max_batch=3) as engine:
        opts = engine.options_for(max_tokens=8, temperature=0.9, seed=7)
        one = dict(engine.generate_batch([(PROMPTS[2], opts)]))[0].token_ids
        mixed = dict(engine.generate_batch([(PROMPTS[0], opts), (PROMPTS[2], opts), (PROMPTS[1], opts)]))
        assert mixed[1].token_ids == one


def test_the_plan_holds_a_cache_slot_per_batched_sequence(converted):
    a = Manifest.open(converted).args
    one = plan_engine(converted, RunOptions(device="cpu", max_context=64))
    four = plan_engine(converted, RunOptions(device="cpu", max_context=64, max_batch=4))
    per = sequence_cache_bytes(a, range(a.n_layers), 64, 4)
    assert cache_slots(1) == 1 and cache_slots(4) == 5
    assert four.kv_cache - one.kv_cache == 4 * per and four.max_batch == 4
    assert "4 batched sequences" in four.table()
    # --max-batch 0: the mode's, as far as an eighth of the device budget holds the caches
    per_v3 = sequence_cache_bytes(a, range(a.n_layers), 4096, 2)
    assert auto_batch(a, 64 * per_v3, 4096, 2, 8) == 8 and auto_batch(a, 24 * per_v3, 4096, 2, 8) == 3
    assert auto_batch(a, per_v3, 4096, 2, 8) == 1
    auto = plan_engine(converted, RunOptions(device="cpu", max_context=64, max_batch=0, mode="latency"))
    assert auto.max_batch == 1


def test_the_default_batch_keeps_its_experts_within_the_tiers(converted):
    """--max-batch 0 caps the batch where its expected union of experts per layer outgrows the device and RAM slots."""
    assert round(expected_union(256, 8, 8), 1) == 57.4 and round(expected_union(256, 8, 16), 1) == 102.0
    a = dataclasses.replace(Manifest.open(converted).args, n_routed_experts=256, n_activated_experts=8)
    plan = plan_engine(converted, RunOptions(device="cpu", max_context=64))
    share = dataclasses.replace(plan, gpu_slots=8, ram_slots=114, total_records=512, expert_layers=(1, 2))
    assert union_batch(a, share, 16) == 8  # 61 slots a layer: 8 sequences' 57 experts fit, 9's 64 do not
    assert union_batch(a, dataclasses.replace(share, ram_slots=504), 16) == 16  # every record held
    auto = plan_engine(converted, RunOptions(device="cpu", max_context=64, max_batch=0))
    assert auto.max_batch == union_batch(Manifest.open(converted).args, auto, auto.max_batch)


def test_batching_is_refused_where_it_cannot_work(converted, v4_converted):
    with pytest.raises(ConfigError, match="--max-batch 17: give 1 to 16"):
        RunOptions(max_batch=17)
    with pytest.raises(ConfigError, match="--max-batch with --mtp"):
        Engine(converted, device="cpu", max_batch=2, mtp=True)
    with pytest.raises(ConfigError, match="DeepSeek-V4.*--max-batch 1"):
        plan_engine(v4_converted, RunOptions(device="cpu", max_context=64, max_batch=2))
    assert plan_engine(v4_converted, RunOptions(device="cpu", max_context=64, max_batch=0)).max_batch == 1
    with Engine(converted, device="cpu", max_context=64) as engine, pytest.raises(ConfigError, match="max_batch >= 2"):
        engine.batch()


def test_a_batch_restores_from_the_prompt_cache_and_the_tokens_stay(converted, tmp_path):
    long = [(i * 7) % 50 + 1 for i in range(40)]
    opts = {"device": "cpu", "max_context": 64, "max_batch": 2, "prompt_cache": tmp_path / "pc"}
    with Engine(converted, **opts) as engine:
        first = dict(engine.generate_batch([(long, engine.options_for(max_tokens=5, temperature=0))]))[0]
    with Engine(converted, **opts) as engine:
        again = dict(engine.generate_batch([(long, engine.options_for(max_tokens=5, temperature=0))]))[0]
    assert again.stats.restored_tokens > 0 and again.token_ids == first.token_ids
    assert torch.is_tensor(torch.tensor(again.token_ids))


def test_other_calls_between_a_batchs_steps_leave_it_alone(converted):
    """A generation or logits call between two steps uses slot 0, not the batch's slots."""
    with Engine(converted, device="cpu", max_context=64, max_batch=2) as engine:
        alone = [_alone(engine, ids, 8) for ids in PROMPTS[:2]]
        run = engine.batch()
        seqs = [run.add(ids, engine.options_for(max_tokens=8, temperature=0)) for ids in PROMPTS[:2]]
        run.step()
        between = engine.generate(PROMPTS[2], max_tokens=4, temperature=0).token_ids
        engine.logits(PROMPTS[3])
        while run.busy:
            run.step()
        assert [s.generation.token_ids for s in seqs] == alone
        assert between == _alone(engine, PROMPTS[2], 4)


def _stepped_batch(engine: Engine):
    run = engine.batch()
    assert run.stepped == 0  # on the CPU, without graphs, prompts prefill (the engine's choice)
    run.stepped = STEPPED_PROMPT_TOKENS  # as the engine sets it where every record is on the device, with graphs
    return run


def _until_done(run, seqs, most: int = 200) -> None:
    for _ in range(most):
        if all(s.generation is not None for s in seqs):
            return
        run.step()
    raise AssertionError("the batch never finished")


@pytest.mark.gpu
def test_steps_run_ahead_through_joins_fed_prompts_and_ends_on_cuda(converted):
    """With graphs, prompts join mid-way and are fed a token a step while each step is launched before the host reads
    the last: tokens as alone; the host waits for a step only at the start and after each end by length; a cancel
    set between steps discards nothing, an EOS the one step launched after it."""
    with Engine(converted, device="cuda", dtype="fp32", max_context=64, max_batch=3, cuda_graph=True) as engine:
        alone = [_alone(engine, ids, n) for ids, n in zip(PROMPTS, TOKENS, strict=True)]
        assert [len(a) for a in alone] == TOKENS  # every end is by length, which the host foresees
        run = engine.batch()
        assert run.stepped
        waited = []  # steps the host launched and then waited for (batch_ahead launches the others)
        step = run.graphs.batch_step
        run.graphs.batch_step = lambda *a: waited.append(a) or step(*a)
        seqs = [run.add(PROMPTS[0], engine.options_for(max_tokens=TOKENS[0], temperature=0))]
        for _ in range(2):  # the others join one at a time, the first still fed its prompt, then decoding
            run.step()
        seqs.append(run.add(PROMPTS[1], engine.options_for(max_tokens=TOKENS[1], temperature=0)))
        run.step()
        seqs.append(run.add(PROMPTS[3], engine.options_for(max_tokens=TOKENS[3], temperature=0)))
        _until_done(run, seqs)
        assert [s.generation.token_ids for s in seqs] == [alone[0], alone[1], alone[3]]
        # the first step, then one after each end but the last
        assert len(waited) <= len(seqs) and run.discarded == 0, (len(waited), run.discarded)
        cancel = threading.Event()
        gone = run.add(PROMPTS[2], engine.options_for(max_tokens=20, temperature=0), cancel)
        kept = run.add(PROMPTS[0], engine.options_for(max_tokens=TOKENS[0], temperature=0))
        for _ in range(len(PROMPTS[2]) + 2):
            run.step()
        cancel.set()  # between steps: the host sees it before it launches the next step, so none is thrown away
        _until_done(run, [gone, kept])
        assert gone.generation.finish_reason == "cancelled" and kept.generation.token_ids == alone[0]
        assert run.discarded == 0
        eos = alone[1][2]  # an end the host cannot foresee: the step launched after it is thrown away
        engine.tokenizer.eos_ids = frozenset({eos})
        ended = run.add(PROMPTS[1], engine.options_for(max_tokens=TOKENS[1], temperature=0))
        _until_done(run, [ended])
        assert ended.generation.finish_reason == "stop"
        assert ended.generation.token_ids == alone[1][: alone[1].index(eos)]
        assert run.discarded == 1


def test_short_prompts_join_through_the_batchs_steps_with_the_tokens_of_alone(converted):
    """Prompts fed a token a step, beside sequences already decoding and joining mid-way: greedy tokens and seeded
    samples as each alone; a prompt cancelled while it is fed leaves the batch; nothing is prefilled."""
    with Engine(converted, device="cpu", max_context=64, max_batch=3) as engine:
        alone = [_alone(engine, ids, n) for ids, n in zip(PROMPTS, TOKENS, strict=True)]
        sampled = engine.generate(PROMPTS[1], max_tokens=8, temperature=0.9, seed=3).token_ids
        run = _stepped_batch(engine)
        prefills = []
        run.hooks = dataclasses.replace(run.hooks, prefill=lambda *a: prefills.append(a))
        greedy = engine.options_for(max_tokens=TOKENS[0], temperature=0)
        seqs = {0: run.add(PROMPTS[0], greedy)}
        for _ in range(3):  # the first is decoding when the others join
            run.step()
        seqs[2] = run.add(PROMPTS[2], engine.options_for(max_tokens=TOKENS[2], temperature=0))
        seqs[9] = run.add(PROMPTS[1], engine.options_for(max_tokens=8, temperature=0.9, seed=3))
        _until_done(run, list(seqs.values()))
        assert seqs[0].generation.token_ids == alone[0] and seqs[2].generation.token_ids == alone[2]
        assert seqs[9].generation.token_ids == sampled
        assert seqs[0].generation.stats.prompt_tokens == len(PROMPTS[0]) and not prefills
        cancel = threading.Event()
        gone = run.add(PROMPTS[2], greedy, cancel)
        kept = run.add(PROMPTS[3], engine.options_for(max_tokens=TOKENS[3], temperature=0))
        run.step()
        cancel.set()
        run.step()
        assert gone.generation.finish_reason == "cancelled" and gone.generation.token_ids == []
        _until_done(run, [kept])
        assert kept.generation.token_ids == alone[3]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_long_prompt_joining_pauses_its_prefill_for_the_running_sequences_steps(converted, streamed):
    """--prefill-yield-ms: the running sequence gets tokens (and on_step sends them) while the long prompt prefills,
    chunk by chunk (every record resident) or layer by layer (experts streamed); both keep the tokens of alone."""
    long_prompt = [(7 * i) % 50 + 3 for i in range(40)]
    options = RunOptions(device="cpu", max_context=64, max_batch=2, prefill_chunk=4, prefill_yield_ms=1)
    plan = dataclasses.replace(plan_engine(converted, options), gpu_slots=3, ram_slots=5) if streamed else None
    with Engine(converted, options, plan=plan) as engine:
        alone = [_alone(engine, PROMPTS[1], 12), _alone(engine, long_prompt, 4)]
        run, sent = engine.batch(), []
        run.on_step = lambda: sent.append(len(first.deltas))
        first = run.add(PROMPTS[1], engine.options_for(max_tokens=12, temperature=0))
        run.yield_s = 1e-9  # every point a pause may take: no wall-clock in the test
        second = run.add(long_prompt, engine.options_for(max_tokens=4, temperature=0))
        assert run.paused_steps > 0 and len(sent) == run.paused_steps and first.steps_taken >= run.paused_steps
        while run.busy:
            run.step()
    assert [first.generation.token_ids, second.generation.token_ids] == alone
