"""From generated tokens to what a caller sees: text detokenized as it comes, EOS and stop strings applied, the
deltas of a stream (text held back while it may still become a stop string or an unfinished UTF-8 character)."""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Iterator

from dsfp4.runtime.generate.decoder import Cancelled
from dsfp4.runtime.generate.generation import Delta, TokenLogprob
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
    if not stop:
        return partial
    # only its end can matter: a batch step does this for every row
    text = text[-(max(map(len, stop)) + partial) :]
    prefix = max(partial_suffix(text, s) for s in stop)
    # a stop string may also end just before the unfinished character
    body = text[: len(text) - partial]
    before = max(partial_suffix(body, s, whole=True) for s in stop)
    return max(prefix, partial + before)


class TextSteps:
    """One generation's tokens into text deltas, a token at a time (plain and speculative decoding pull them through
    text_deltas; a batch pushes each sequence's as its steps make them): detokenized as they come, EOS and stop
    strings applied, at most `budget` tokens, counted with the time to the first into `stats` (from perf_counter
    `start`). `finish` is set once the generation ends: "stop" or "length" (or "cancelled", by the caller).
    `logprobs`: the sequence's rules' entries, one per token generated (TokenRules.logprobs; None: not asked)."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        stop: tuple[str, ...],
        budget: int,
        stats: GenerationStats,
        start: float,
        logprobs: list[TokenLogprob] | None = None,
    ):
        self.tokenizer, self.stop, self.budget, self.stats, self.start = tokenizer, stop, budget, stats, start
        self.logprobs = logprobs
        # kept (EOS is not)
        self.tokens: list[int] = []
        self.text, self.emitted, self.finish = "", 0, None
        self.detok = TextStream(tokenizer)
        self.arrivals: list[float] = []

    def add(self, token: int) -> Delta | None:
        """The next generated token -> the delta it makes (None when it ends the text: EOS or a stop string)."""
        stats = self.stats
        self.arrivals.append(time.perf_counter())
        stats.generated_tokens += 1
        if stats.generated_tokens == 1:
            stats.ttft_s = stats.prefill_s = self.arrivals[0] - self.start
        if token in self.tokenizer.eos_ids:
            self.finish = "stop"
            return None
        self.tokens.append(token)
        text = self.text = self.detok.add(token)
        # text[:emitted] is final and held no stop string: a new one ends after it
        emitted = self.emitted
        if hits := [i for s in self.stop if (i := text.find(s, max(emitted - len(s) + 1, 0))) >= 0]:
            self.text, self.finish = text[: min(hits)], "stop"
            return None
        end = max(len(text) - held_back(text, self.stop), emitted)
        self.emitted = end
        if self.spent:
            self.finish = "length"
        entry = self.logprobs[stats.generated_tokens - 1] if self.logprobs is not None else None
        return Delta(token, text[emitted:end], entry)

    def kept_logprobs(self) -> list[TokenLogprob] | None:
        """The entries of the tokens kept (EOS, always the last, is not)."""
        return None if self.logprobs is None else self.logprobs[: len(self.tokens)]

    @property
    def spent(self) -> bool:
        """The budget's tokens are all generated."""
        return self.stats.generated_tokens >= self.budget

    @property
    def last_is_next(self) -> bool:
        """The next token is the budget's last (a batch launches no step after it)."""
        return self.stats.generated_tokens + 1 >= self.budget

    def end(self) -> Delta | None:
        """The generation is over (finish "length" unless set): the inter-token times into the stats -> the last
        flush of text held back, if any."""
        self.finish = self.finish or "length"
        gaps = sorted(b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False))
        self.stats.itl_p50_s, self.stats.itl_p99_s = percentile(gaps, 50), percentile(gaps, 99)
        return Delta(None, self.text[self.emitted :]) if len(self.text) > self.emitted else None


def text_deltas(
    source: Iterator[int],
    tokenizer: ChatTokenizer,
    stop: tuple[str, ...],
    budget: int,
    stats: GenerationStats,
    start: float,
    logprobs: list[TokenLogprob] | None = None,
) -> Generator[Delta, None, tuple[list[int], str, str]]:
    """TextSteps' deltas of the tokens from `source` (plain or speculative decoding; `logprobs`: TextSteps'). Returns
    (token ids kept, text, finish reason: "stop", "length" or "cancelled"). The source is closed at the end, so the
    caches stay consistent."""
    steps = TextSteps(tokenizer, stop, budget, stats, start, logprobs)
    try:
        for token in source:
            if (delta := steps.add(token)) is not None:
                # the cache is consistent here, should the caller stop
                yield delta
            if steps.finish is not None:
                break
    except Cancelled:
        steps.finish = "cancelled"
    finally:
        source.close()
    if (last := steps.end()) is not None:
        yield last
    return steps.tokens, steps.text, steps.finish
