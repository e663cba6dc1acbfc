"""Choosing the next token: greedy at temperature 0, else temperature, top-k and top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0  # 0: off
    seed: int | None = None


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [V] fp32 -> a token id."""
    if p.temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs > p.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
