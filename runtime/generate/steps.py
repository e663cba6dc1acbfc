"""From generated tokens to what a caller sees: text detokenized as it comes, EOS and stop strings applied, the
deltas of a stream (text held back while it may still become a stop string or an unfinished UTF-8 character)."""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Iterator

from dsfp4.runtime.generate.decoder import Cancelled
from dsfp4.runtime.generate.generation import Delta
from dsfp4.runtime.generate.reasoning import partial_suffix
from dsfp4.runtime.generate.stats import GenerationStats
from dsfp4.runtime.generate.tokenizer import ChatTokenizer, TextStream


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def percentile(ordered: list[float], q: float) -> float:
    """The q-th percentile of sorted values, nearest rank (0 for none)."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """How many trailing characters may still become a stop string or an unfinished UTF-8 character."""
    partial = len(text) - len(text.rstrip("\ufffd"))
    prefix = max((partial_suffix(text, s) for s in stop), default=0)
    body = text[: len(text) - partial]  # a stop string may also end just before the unfinished character
    before = max((partial_suffix(body, s, whole=True) for s in stop), default=0)
    return max(prefix, partial + before)


def text_deltas(
    source: Iterator[int],
    tokenizer: ChatTokenizer,
    stop: tuple[str, ...],
    budget: int,
    stats: GenerationStats,
    start: float,
) -> Generator[Delta, None, tuple[list[int], str, str]]:
    """Deltas of the tokens from `source` (plain or speculative decoding, started at perf_counter `start`), at most
    `budget` of them; counts them and the time to the first into `stats`. Returns (token ids kept, text, finish
    reason: "stop", "length" or "cancelled"). The source is closed at the end, so the caches stay consistent."""
    tokens: list[int] = []
    text, emitted, finish, detok = "", 0, "length", TextStream(tokenizer)
    arrivals: list[float] = []
    try:
        for token in source:
            arrivals.append(time.perf_counter())
            stats.generated_tokens += 1
            if stats.generated_tokens == 1:
                stats.ttft_s = stats.prefill_s = arrivals[0] - start
            if token in tokenizer.eos_ids:
                finish = "stop"
                break
            tokens.append(token)
            text = detok.add(token)
            # text[:emitted] is final and held no stop string: a new one ends after it
            if hits := [i for s in stop if (i := text.find(s, max(emitted - len(s) + 1, 0))) >= 0]:
                text, finish = text[: min(hits)], "stop"
                break
            end = max(len(text) - held_back(text, stop), emitted)
            yield Delta(token, text[emitted:end])  # the cache is consistent here, should the caller stop
            emitted = end
            if stats.generated_tokens >= budget:
                break
    except Cancelled:
        finish = "cancelled"
    finally:
        source.close()
    gaps = sorted(b - a for a, b in zip(arrivals, arrivals[1:], strict=False))
    stats.itl_p50_s, stats.itl_p99_s = percentile(gaps, 50), percentile(gaps, 99)
    if len(text) > emitted:
        yield Delta(None, text[emitted:])
    return tokens, text, finish
