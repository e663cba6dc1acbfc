"""Prompts prefilled together, layer by layer (runtime/generate/joint_prefill.py, Engine.prefill_together; `run --batch`
with --prompt-cache): each prompt's generation then restores its KV and gives the tokens of prefilling it alone, each
layer's records are read once for the group, and groups stay within their bound."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.manifest import Manifest
from dsfp4.layout.routing_trace import RoutingTrace, write_trace
from dsfp4.runtime.engine import Engine
from dsfp4.runtime.generate.joint_prefill import groups, layer_of
from dsfp4.runtime.models.load import plan_engine
from dsfp4.runtime.options import RunOptions
from tests.fixtures.cli import run_cli

LENGTHS = (40, 57, 71)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 600, (n,), generator=g).tolist() for n in LENGTHS]


def test_groups_keep_order_and_bound():
    assert groups([10, 20, 30, 5], limit=35) == [[0, 1], [2, 3]]
    assert groups([50, 10], limit=35) == [[0], [1]]  # one longer than the bound goes alone
    assert groups([], limit=35) == []
    assert layer_of("layers.3.attn.kv_cache") == 3 and layer_of("mtp.0.block.attn.kv_cache") is None


def _one_layer_of_ram(converted, options: RunOptions):
    """A plan whose RAM holds one layer's records and whose device holds one token's: the records stream."""
    plan = plan_engine(converted, options)
    n, k = Manifest.read(converted).args.n_routed_experts, Manifest.read(converted).args.n_activated_experts
    return dataclasses.replace(plan, gpu_slots=k, ram_slots=n, staging=min(4, n))


def test_prompts_prefilled_together_generate_the_tokens_of_each_alone_reading_each_record_once(converted, tmp_path):
    prompts = _prompts()
    alone_options = RunOptions(device="cpu", max_context=128)
    with Engine(converted, alone_options, plan=_one_layer_of_ram(converted, alone_options)) as alone:
        before = alone.model.experts.counters.snapshot()["ssd_reads"]
        want = [alone.generate(p, max_tokens=1, temperature=0).token_ids for p in prompts]
        sequential = alone.model.experts.counters.snapshot()["ssd_reads"] - before
        want = [alone.generate(p, max_tokens=6, temperature=0).token_ids for p in prompts]
    options = RunOptions(device="cpu", max_context=128, prompt_cache=tmp_path / "pc")
    with Engine(converted, options, plan=_one_layer_of_ram(converted, options)) as e:
        before = e.model.experts.counters.snapshot()["ssd_reads"]
        assert e.prefill_together(prompts) == sum(n - 1 for n in LENGTHS)
        joint = e.model.experts.counters.snapshot()["ssd_reads"] - before
        assert joint <= e.model.experts.plan.total_records < sequential  # each record once, not once per prompt
        for p, w in zip(prompts, want, strict=True):
            g = e.generate(p, max_tokens=6, temperature=0)
            assert g.token_ids == w and g.stats.restored_tokens == len(p) - 1
    assert len(list((tmp_path / "pc").iterdir())) == len(prompts)


def test_without_a_prompt_cache_it_is_refused_and_short_prompts_are_left_to_generate(converted, tmp_path):
    with (
        Engine(converted, RunOptions(device="cpu", max_context=128)) as e,
        pytest.raises(ConfigError, match="prompt-cache"),
    ):
        e.prefill_together(_prompts())
    with Engine(converted, RunOptions(device="cpu", max_context=128, prompt_cache=tmp_path / "pc")) as e:
        assert e.prefill_together([[5, 6, 7]]) == 0  # too short to be worth an entry


def test_a_batch_with_a_prompt_cache_prefills_together_and_answers_as_without(converted, tmp_path):
    lines = [{"prompt": p, "raw": True, "max_tokens": 5} for p in ("alpha beta " * 20, "gamma delta " * 25)]
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    base = ("run", converted, "--batch", batch, "--temperature", 0, "--device", "cpu", "--max-context", 1024)
    plain = run_cli(*base, "--output", tmp_path / "a.jsonl", "-q")
    joint = run_cli(*base, "--output", tmp_path / "b.jsonl", "--prompt-cache", tmp_path / "pc")
    assert plain.exit_code == 0 and joint.exit_code == 0, joint.output
    assert "prefilled layer by layer together" in joint.stderr
    a, b = ([json.loads(x) for x in (tmp_path / f).read_text().splitlines()] for f in ("a.jsonl", "b.jsonl"))
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in b]
    assert all(x["stats"]["restored_tokens"] > 0 for x in b)


def test_prompts_joining_a_batch_together_prefill_layer_by_layer_into_their_slots(converted, tmp_path):
    """Where records stream, prompts that join a batch at once prefill together straight into their batch slots
    (BatchRun.add_many): each decodes the tokens it gets alone, and the prefill reads each record once, not once per
    prompt. Where the tiers hold every record they prefill one by one."""
    prompts = _prompts()
    options = RunOptions(device="cpu", max_context=128, max_batch=len(prompts))
    with Engine(converted, options, plan=_one_layer_of_ram(converted, options)) as e:
        counters = e.model.experts.counters
        want = [e.generate(p, max_tokens=6, temperature=0).token_ids for p in prompts]
        before = counters.snapshot()["ssd_reads"]
        for p in reversed(prompts):  # prompts[0] last: slot 0 holds it when the batch starts
            e.reset()
            e.generate(p, max_tokens=1, temperature=0)
        one_by_one = counters.snapshot()["ssd_reads"] - before
        run, reported = e.batch(), []
        assert run.joint
        run.progress = lambda done, total: reported.append((done, total))
        before = counters.snapshot()["ssd_reads"]
        seqs = run.add_many([(p, e.options_for(max_tokens=6, temperature=0), None) for p in prompts])
        joint = counters.snapshot()["ssd_reads"] - before
        assert joint <= e.model.experts.plan.total_records < one_by_one
        # the pass's progress: the prompts' tokens but their last, done of all, in order, to the end
        total = sum(len(p) - 1 for p in prompts)
        assert {t for _, t in reported} == {total} and reported[-1][0] == total
        assert [d for d, _ in reported] == sorted(d for d, _ in reported)
        assert all(s.pos == len(p) - 1 and s.token == p[-1] for s, p in zip(seqs, prompts, strict=True))
        while run.busy:
            run.step()
        assert [s.generation.token_ids for s in seqs] == want
        assert e.generate(prompts[0], max_tokens=6, temperature=0).token_ids == want[0]  # slot 0 forgotten, refilled
    with Engine(converted, options) as resident:
        assert not resident.batch().joint  # every record held: one by one, reusing slot 0's prefix
    cached = dataclasses.replace(options, prompt_cache=tmp_path / "pc")
    with Engine(converted, cached, plan=_one_layer_of_ram(converted, cached)) as e:
        assert not e.batch().joint  # one by one: each prefill restores what the prompt cache saved


def test_under_a_routing_trace_joining_prompts_prefill_together_each_through_rows_of_its_own(
    converted, tmp_path, monkeypatch
):
    """A benchmark's routing trace keeps the joint prefill: each joining prompt's tokens route through a stretch of the
    trace's rows of its own (reserved from the cursor on, in order), begun before each chunk enters a block; with a
    trace whose rows are all alike the tokens are those of each prompt alone."""
    with Engine(converted, device="cpu", max_context=128) as engine:
        moe_layers = sum(1 for b in engine.model.layers if b.moe)
    trace = tmp_path / "fixed.npy"
    write_trace(trace, RoutingTrace(np.tile(np.array([5, 2], dtype=np.int32), (1000, moe_layers, 1))))
    prompts = _prompts()
    options = RunOptions(device="cpu", max_context=128, max_batch=len(prompts), routing=trace)
    with Engine(converted, options, plan=_one_layer_of_ram(converted, options)) as e:
        want = [e.generate(p, max_tokens=6, temperature=0).token_ids for p in prompts]
        run, routing = e.batch(), e.routing
        assert run.joint
        begun, real = [], routing.begin_rows
        monkeypatch.setattr(routing, "begin_rows", lambda rows: (begun.append(list(rows)), real(rows))[1])
        cursor = routing.cursor
        seqs = run.add_many([(p, e.options_for(max_tokens=6, temperature=0), None) for p in prompts])
        prefilled = sum(n - 1 for n in LENGTHS)
        assert sorted({r for rows in begun for r in rows}) == list(range(cursor, cursor + prefilled))
        assert all(rows == list(range(rows[0], rows[0] + len(rows))) for rows in begun)  # a chunk: consecutive rows
        while run.busy:
            run.step()
        assert [s.generation.token_ids for s in seqs] == want
