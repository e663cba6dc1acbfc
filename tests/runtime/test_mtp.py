"""MTP speculative decoding: greedy tokens equal plain decoding's across prompts, lengths and cache budgets,
with every draft rejected or every draft kept (forced through the test hook); the sampling rule keeps the
target distribution (exactly, by a chi-square test on 20,000 draws, and end to end on the tiny model);
the adaptive switch; the CLI flag."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest
import torch

from dsfp4 import Engine, RunOptions
from dsfp4.convert.pipeline import convert
from dsfp4.convert.plan import ConvertOptions
from dsfp4.errors import ConfigError
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.generate.sampling import check_draft, distribution, draw
from dsfp4.runtime.generate.sampling_params import SamplingParams
from dsfp4.runtime.generate.speculative import JUDGE_AFTER
from dsfp4.runtime.models.load import plan_run
from tests.fixtures.cli import run_cli

PROMPTS = ["Why is the sky blue?", "hello", "Write a haiku about SSDs"]
CPU = torch.device("cpu")


def _engine(model, mtp: bool, slots: tuple[int, int] | None = None, **knobs) -> Engine:
    options = RunOptions(**{"device": "cpu", "max_context": 64, "mtp": mtp, **knobs})
    plan = None
    if slots:  # tiny tiers: experts come and go between the verify step's tokens
        plan = plan_run(Manifest.read(model), CPU, torch.float32, 64, options, mtp)
        plan = dataclasses.replace(plan, gpu_slots=slots[0], ram_slots=slots[1], staging=min(4, slots[1]))
    engine = Engine(model, options, plan=plan)
    if mtp:
        engine.speculator.adaptive, engine.speculator.probe_plain = False, 0
    return engine


def _chi2_p(observed: Counter, expected: dict[int, float], n: int) -> float:
    """p-value of Pearson's chi-square test of counts against probabilities (bins under 5 expected merged)."""
    big = [k for k, p in expected.items() if p * n >= 5]
    rest_p = 1 - sum(expected[k] for k in big)
    stat = sum((observed[k] - expected[k] * n) ** 2 / (expected[k] * n) for k in big)
    if rest_p * n >= 5:
        rest = n - sum(observed[k] for k in big)
        stat += (rest - rest_p * n) ** 2 / (rest_p * n)
        dof = len(big)
    else:
        dof = len(big) - 1
    return _chi2_sf(stat, dof)


def _chi2_sf(x: float, k: int) -> float:
    """Survival function of the chi-square distribution (regularized upper gamma, by series)."""
    a, t = k / 2, x / 2
    term = total = 1 / a
    for i in range(1, 1000):
        term *= t / (a + i)
        total += term
    lower = math.exp(-t + a * math.log(t) - math.lgamma(a)) * total if t > 0 else 0.0
    return max(0.0, 1 - lower)


@pytest.mark.parametrize("slots", [None, (3, 5), (2, 1)])
@pytest.mark.slow
def test_greedy_tokens_equal_plain_decoding_with_drafts_natural_rejected_or_kept(converted, slots):
    plain = _engine(converted, False)
    mtp = _engine(converted, True, slots)
    vocab = plain.model.args.vocab_size
    try:
        for prompt, n in zip(PROMPTS, (12, 5, 20), strict=True):
            ref = plain.generate(prompt, max_tokens=n, temperature=0)
            seq = ref.prompt_ids + ref.token_ids
            runs = {
                "natural": None,
                "kept": lambda pos, d, seq=seq: seq[pos] if pos < len(seq) else d,
                "rejected": lambda pos, d, seq=seq: (seq[pos] + 1) % vocab if pos < len(seq) else d,
            }
            for name, override in runs.items():
                mtp.speculator.override = override
                g = mtp.generate(prompt, max_tokens=n, temperature=0)
                assert g.token_ids == ref.token_ids and g.text == ref.text, (prompt, name)
                assert g.stats.drafted > 0
                if name == "kept":
                    assert g.stats.accepted >= g.stats.drafted - 1  # the last may draft beyond the reference
                if name == "rejected":
                    assert g.stats.accepted == 0
    finally:
        plain.close()
        mtp.close()


@pytest.mark.slow
def test_one_token_chunks_and_the_end_of_the_context(converted):
    ids = list(range(3, 23))  # 20 prompt tokens in a 24-token context: the last steps have no room to draft
    with (
        _engine(converted, False, max_context=24) as plain,
        _engine(converted, True, max_context=24, prefill_chunk=1) as mtp,
    ):
        want = plain.generate(ids, max_tokens=50, temperature=0)
        g = mtp.generate(ids, max_tokens=50, temperature=0)
        assert g.token_ids == want.token_ids and g.stats.drafted > 0
        for prompt in PROMPTS:
            assert (
                mtp.generate(prompt, max_tokens=9, temperature=0).token_ids
                == plain.generate(prompt, max_tokens=9, temperature=0).token_ids
            )


def test_reused_mtp_entries_are_those_a_fresh_engine_computes(converted, monkeypatch):
    """Greedy output cannot show a stale MTP entry (the check corrects the draft); the draft logits can."""
    from dsfp4.runtime.generate.speculative import Speculator

    seen: list[torch.Tensor] = []
    real = Speculator._draft
    monkeypatch.setattr(Speculator, "_draft", lambda self, logits, *a: seen.append(logits) or real(self, logits, *a))
    long = PROMPTS[0] + " and why is the sea blue, and the grass green?"
    with _engine(converted, True) as engine:
        engine.generate(long, max_tokens=6, temperature=0)  # leaves entries past the shared prefix
        ids = engine.encode(PROMPTS[0])
        first = engine.generate(ids, max_tokens=1, temperature=0)  # plain: recomputes the main cache only
        seen.clear()
        engine.generate(ids + first.token_ids, max_tokens=3, temperature=0)
        reused = seen[0]
    with _engine(converted, True) as fresh:
        seen.clear()
        fresh.generate(ids + first.token_ids, max_tokens=3, temperature=0)
    torch.testing.assert_close(reused, seen[0], rtol=1e-4, atol=1e-4)


def test_chat_turns_with_mtp_reuse_the_cache_and_give_the_tokens_of_plain_decoding(converted):
    chat = [{"role": "user", "content": "hello"}]
    with _engine(converted, False) as plain, _engine(converted, True) as mtp:
        first = mtp.generate(chat, max_tokens=6, temperature=0)
        assert first.token_ids == plain.generate(chat, max_tokens=6, temperature=0).token_ids
        chat += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "more"}]
        second = mtp.generate(chat, max_tokens=8, temperature=0)
        plain.reset()
        assert second.token_ids == plain.generate(chat, max_tokens=8, temperature=0).token_ids
        assert second.stats.cached_tokens > 0  # the first turn's prefix, less what the MTP entries lack


@pytest.mark.parametrize("top_p", [1.0, 0.7])  # 0.7 cuts the target's tail: p and q are renormalized
@pytest.mark.slow
def test_the_sampling_rule_keeps_the_target_distribution(top_p):
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    target = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    p = distribution(target, params)
    assert float(p.sum()) == pytest.approx(1.0)
    expected = {k: float(v) for k, v in enumerate(p)}
    for draft_logits in (torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0, -2.0]), target + 0.3 * torch.randn(6, generator=gen)):
        q = distribution(draft_logits, params)
        n, counts, kept = 20000, Counter(), 0
        for _ in range(n):
            d = draw(q, gen)
            token, ok = check_draft(target, q, d, params, gen)
            counts[token] += 1
            kept += ok
        assert _chi2_p(counts, expected, n) > 1e-3, counts  # tokens follow p
        assert abs(kept / n - float(torch.minimum(p, q).sum())) < 0.02  # acceptance = sum min(p, q)
    drafts = Counter(draw(q, gen) for _ in range(n))
    assert _chi2_p(drafts, {k: max(v, 1e-9) for k, v in expected.items()}, n) < 1e-6  # it tells q from p
    greedy = SamplingParams(temperature=0)
    assert check_draft(target, None, 0, greedy, None) == (0, True)
    assert check_draft(target, None, 3, greedy, None) == (0, False)


@pytest.mark.slow
def test_sampling_with_mtp_draws_the_second_token_as_plain_sampling_does(converted):
    """Over 240 seeds at temperature 1.5 and top-k 4, the second generated token (the first one a verify
    step decides) has the same distribution with and without MTP: a two-sample chi-square test, p > 1e-3."""
    knobs = {"temperature": 1.5, "top_k": 4, "top_p": 1.0}
    counts = []
    for mtp in (False, True):
        with _engine(converted, mtp) as engine:
            seen = Counter()
            for seed in range(240):
                seen[tuple(engine.generate("hello", max_tokens=2, seed=seed, **knobs).token_ids[1:])] += 1
            counts.append(seen)
    keys = set(counts[0]) | set(counts[1])
    pooled = {k: (counts[0][k] + counts[1][k]) / 480 for k in keys}
    stat, dof = 0.0, -1
    for k in keys:
        if pooled[k] * 240 >= 5:
            stat += sum((c[k] - pooled[k] * 240) ** 2 / (pooled[k] * 240) for c in counts)
            dof += 1
    assert dof >= 2 and _chi2_sf(stat, dof) > 1e-3, counts


def test_drafting_that_does_not_pay_falls_back_to_plain_decoding(converted):
    with Engine(converted, device="cpu", max_context=64, mtp=True) as engine:
        fed, forward = [], engine.decoder.forward
        engine.decoder.forward = lambda piece, *a, **k: (fed.append(len(piece)), forward(piece, *a, **k))[1]
        engine.speculator.clock = lambda: float(sum(fed))  # a step costs the tokens it feeds: no wall clock
        g = engine.generate(PROMPTS[0], max_tokens=40, temperature=0)  # random weights: drafts are rejected
    s = g.stats  # a verify step costs two plain ones for about the same 1 token: judged after each from the 8th
    assert s.drafted >= JUDGE_AFTER and s.plain_steps > 2 and "drafting stopped after" in s.mtp_note
    assert "MTP" in s.table() and s.to_dict()["tokens_per_verify"] == pytest.approx(1 + s.accepted / s.drafted)


def test_the_switch_compares_measured_speeds():
    from dsfp4.runtime.generate.speculative import _pays
    from dsfp4.runtime.generate.stats import GenerationStats

    def stats(accepted: int, verify_s: float) -> GenerationStats:
        return GenerationStats(drafted=10, accepted=accepted, verify_s=verify_s, plain_steps=4, plain_s=0.4)

    assert _pays(stats(9, 1.5)) and not _pays(stats(9, 2.0)) and not _pays(stats(0, 1.1)) and _pays(stats(0, 0.9))


def test_run_mtp_flag_and_a_model_without_the_layer(converted, checkpoints, tmp_path):
    flags = ["--prompt", "hello", "--temperature", "0", "--max-tokens", "10", "--device", "cpu", "--json"]
    plain = json.loads(run_cli("run", converted, *flags).stdout)
    r = run_cli("run", converted, *flags, "--mtp", "--stats")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["token_ids"] == plain["token_ids"] and "MTP" in r.stderr
    out = tmp_path / "no-mtp"
    convert(checkpoints["fp8"], out, ConvertOptions(no_mtp=True), progress=False)
    with pytest.raises(ConfigError, match="--mtp: .* has no MTP layer"):
        Engine(out, device="cpu", mtp=True)


def test_the_server_decodes_with_mtp_and_answers_as_without(converted):
    from fastapi.testclient import TestClient

    from dsfp4.server.app import Served, create_app

    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 10, "temperature": 0}
    answers = []
    for mtp in (False, True):
        with _engine(converted, mtp) as engine, TestClient(create_app(engine, Served("fp8"))) as client:
            r = client.post("/v1/chat/completions", json=body).json()
            answers.append((r["choices"][0]["message"]["content"], r["stats"]["drafted"]))
    assert answers[0][0] == answers[1][0] and answers[0][1] == 0 and answers[1][1] > 0
