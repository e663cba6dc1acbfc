"""Choosing the next token: greedy at temperature 0, else temperature, min-p, top-k and top-p sampling; and the
speculative-sampling rule that checks a drafted token against the model's own distribution. What a sequence does to
its logits before this (penalties, a grammar's mask, log-probabilities) is logits_rules.py's; the parameters
(SamplingParams) are sampling_params.py's."""

from __future__ import annotations

import math

import torch

from dsfp4.runtime.generate.sampling_params import SamplingParams


def distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: [V] -> the probabilities sampling draws from [V] fp32 (not greedy: its callers take the argmax)."""
    assert not p.greedy, "greedy decoding takes the argmax, not a distribution"
    logits = logits.float() / p.temperature
    if p.min_p > 0:
        # log(min_p * top probability), relative to the top logit: the softmax's sum cancels
        floor = logits.max() + math.log(p.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest set reaching top_p
        outside = sorted_probs.cumsum(0) - sorted_probs > p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
        # a distribution again: the draft check compares p and q as such
        probs = probs / probs.sum()
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token id drawn from probs [V] (which need not be normalized)."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def choose(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [V] -> a token id as a 0-d long tensor on their device, with no host sync (pipelined decode).
    Sampling is an exponential race, argmax(probs / E) with E ~ Exp(1) drawn by `generator` (on that
    device): it draws the same distribution as a multinomial without leaving the device."""
    if p.greedy:
        return logits.argmax()
    probs = distribution(logits, p)
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax()


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] fp32 -> a token id."""
    if p.greedy:
        return int(logits.argmax())
    return draw(distribution(logits, p), generator)


def check_draft(
    target: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft: int,
    p: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, bool]:
    """Speculative sampling: keep `draft` (drawn from draft_probs [V]) with probability min(1, p/q) under the
    target logits [V]; else draw from the leftover max(p - q, 0). The token returned is distributed exactly
    as sampling from the target would be. Greedy (no draft_probs needed) keeps the draft iff it is the
    target's argmax."""
    if p.greedy:
        best = int(target.argmax())
        return best, best == draft
    probs = distribution(target, p)
    pd, qd = float(probs[draft]), float(draft_probs[draft])
    if float(torch.rand((), generator=generator)) * qd < pd:
        return draft, True
    leftover = (probs - draft_probs).clamp_min(0)
    return draw(leftover if float(leftover.sum()) > 0 else probs, generator), False
