"""The decoding core: one sequence through the model. It keeps the tokens whose KV the caches hold, runs forward
passes after them (a captured CUDA graph for one token when one is ready), feeds prompts in chunks and decodes
plainly. The engine and speculative decoding both drive the model through it, and only through it.

Where the routed experts stream (the store does not reach them all without the host), a prompt longer than one chunk
is fed layer by layer (layer_pass.py): its tokens through a block's attention, in pieces of the plan's attention_group
tokens, then the block's feed-forward over groups of the prompt's tokens, before block L+1, so each layer's records are
brought in once per group (the plan's prefill_group tokens), not once per chunk, and the cached keys are expanded once
per piece. A piece's attention in block L reads the rows its earlier pieces wrote there, as it would have chunk by
chunk: the same computations in another order, the same KV and logits. A pass cancelled inside the blocks keeps none of
its chunks. Where every record is reached in place, chunks go through all the blocks one after another, as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from dsfp4.runtime.generate.decode_graph import DecodeGraphs
from dsfp4.runtime.generate.layer_pass import prepare, run_blocks, tokens_done, trace_rows
from dsfp4.runtime.generate.logits_rules import TokenRules, pick
from dsfp4.runtime.generate.sampling import choose
from dsfp4.runtime.generate.sampling_params import SamplingParams
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.models.trace_routing import TraceRouting
from dsfp4.runtime.profile.recorder import RoutingRecorder


class Cancelled(Exception):
    """The caller's cancel event was set: the generation ends at the next chunk or token."""


def by_layer(tokens: int, chunk: int, visible: bool) -> bool:
    """A prompt of `tokens` goes through the model layer by layer (every chunk through a block before the next block)
    where the experts stream (not `visible`: the kernels do not reach every record without the host) and it takes
    more than one chunk of more than one token; the projection's prefill follows the same rule. Chunks of one token
    are decode steps, each through every block (`--prefill-chunk 1`: eval scores the levers token by token, as they
    act in decode, docs/eval.md). Where every record is resident, a chunk through every block after another was the
    faster order on the H200 at 2k-32k tokens, the larger attention calls of a layer-wise pass included
    (docs/BENCHMARKS.md)."""
    return tokens > chunk > 1 and not visible


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled


class Decoder:
    """The model, its decode graphs (None: eager steps only), routing recorder (None: not recorded) and routing
    trace (None: the routers route), and the tokens its caches hold (`cached`). Prompts go in chunks of
    `prefill_chunk` tokens; fed layer by layer, their feed-forward takes `prefill_group` tokens at once."""

    def __init__(
        self,
        model: Model,
        graphs: DecodeGraphs | None,
        recorder: RoutingRecorder | None,
        prefill_chunk: int,
        max_context: int,
        routing: TraceRouting | None = None,
        prefill_group: int = 0,
        attention_group: int = 0,
    ):
        self.model, self.graphs, self.recorder, self.routing = model, graphs, recorder, routing
        self.prefill_chunk, self.max_context, self.prefill_group = prefill_chunk, max_context, prefill_group
        self.attention_group = attention_group
        self.cached: list[int] = []
        # (prompt tokens done, of how many) as a feed advances, from (0, n) on: what a progress display reads
        self.progress: Callable[[int, int], None] | None = None
        # called where a feed may stop for other work on the model that leaves this sequence's cache slot alone (a
        # batch's step of its running sequences: batch.py), between chunks and a layer-wise pass's pieces of work
        self.pause: Callable[[], None] | None = None

    @property
    def replays(self) -> bool:
        """Single-token steps replay captured graphs."""
        return self.graphs is not None and self.graphs.ready

    def truncate(self, n: int) -> None:
        """Keep the first n cached positions: later ones belong to other tokens (their KV is overwritten)."""
        self.cached = self.cached[:n]

    def drop_last(self) -> None:
        """The last cached position holds a token that was not kept (a rejected draft): the next pass overwrites
        its KV."""
        self.cached.pop()

    def forward(
        self, piece: list[int], cancel: threading.Event | None = None, every: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of piece after the cached tokens -> (logits after its last token [V], or after every
        token [t, V] when `every`; final hidden states [t, D]). The cached tokens grow by the piece."""
        _check(cancel)
        with self._pass(piece):
            if len(piece) == 1 and not every and self.replays:
                logits, h = self.graphs.step(piece[0], len(self.cached))
            else:
                tokens = torch.tensor([piece], device=self.model.device)
                if self.routing is not None:
                    self.routing.begin(len(piece))
                logits, h = self.model(tokens, len(self.cached), last_only=not every)
        return (logits[0] if every else logits[0, -1]), h[0]

    @contextmanager
    def _pass(self, ids: list[int]) -> Iterator[None]:
        """A pass of ids after the cached tokens: once it completes its routing is committed and the cached tokens
        grow by ids; an interrupted pass leaves nothing half-recorded."""
        try:
            yield
        except BaseException:
            if self.recorder is not None:
                self.recorder.discard()
            raise
        if self.recorder is not None:
            self.recorder.commit(ids)
        self.cached += ids

    def feed(
        self, ids: list[int], cancel: threading.Event | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Feed ids after the cached tokens in chunks: yields each chunk's forward (logits [V], hidden [t, D]); layer
        by layer where experts stream and ids take more than one chunk (by_layer, the module's docstring)."""
        self._advanced(0, len(ids))
        if by_layer(len(ids), self.prefill_chunk, self.model.experts.visible):
            yield from self._feed_by_layer(ids, cancel)
            return
        for i in range(0, len(ids), self.prefill_chunk):
            out = self.forward(ids[i : i + self.prefill_chunk], cancel)
            self._advanced(min(i + self.prefill_chunk, len(ids)), len(ids))
            yield out

    @contextmanager
    def pausing(self, pause: Callable[[], None] | None) -> Iterator[None]:
        """While the block runs, feeds call `pause` where they may stop (None: nowhere)."""
        self.pause = pause
        try:
            yield
        finally:
            self.pause = None

    def _advanced(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)
        if self.pause is not None and 0 < done < total:
            self.pause()

    def _feed_by_layer(
        self, ids: list[int], cancel: threading.Event | None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """feed, every chunk through a block before the next block: yields each chunk's (logits after its last token
        [V], hidden [t, D]) once every block has taken every chunk."""
        model, start = self.model, len(self.cached)
        _check(cancel)
        with self._pass(ids):
            lp = prepare(model, [ids], [start], self.prefill_chunk, self.prefill_group, self.attention_group)
            if self.routing is not None:
                # a trace routes token i of the prompt by the row after the cursor, whichever block runs it
                first = [self.routing.reserve(len(ids))]
                lp.routed = lambda g: self.routing.begin_rows(trace_rows(g, first))
            for i, share in run_blocks(model, lp):
                _check(cancel)
                self._advanced(tokens_done(i, share, len(model.layers), len(ids)), len(ids))
        x = lp.hidden[0]  # [1, T, ...] after every block
        for p in lp.chunks:
            logits, h = model.finish(x[:, p.at : p.at + p.n].to(model.device), start + len(ids), last_only=True)
            yield logits[0, -1], h[0]

    def prefill(self, ids: list[int], cancel: threading.Event | None = None) -> torch.Tensor:
        """Feed ids after the cached tokens (in chunks) -> the logits after the last one [V]; each chunk's tensors go
        as the next one comes."""
        return deque(self.feed(ids, cancel), maxlen=1)[0][0]

    def decode(
        self,
        ids: list[int],
        sampling: SamplingParams,
        gen: torch.Generator | None,
        cancel: threading.Event | None,
        budget: int,
        rules: TokenRules | None = None,
    ) -> Iterator[int]:
        """Plain decoding: prefill ids after the cached tokens, then yield tokens. Replayed steps run one ahead
        of the host (DecodeGraphs.tokens, sampling on the device); eager ones, and those of a sequence with `rules`
        (which the host applies to each step's logits: replayed, not ahead), feed a token to the model only when the
        next one is asked for (so the last one never is)."""
        logits = self.prefill(ids, cancel)
        if self.replays and rules is None:
            seed = sampling.seed
            on_device = None if seed is None else torch.Generator(self.model.device).manual_seed(seed)
            start = len(self.cached)
            yield from self.graphs.tokens(
                logits, start, lambda x: choose(x, sampling, on_device), budget, lambda t: self._keep(t, cancel)
            )
            return
        while True:
            token = pick(rules, logits, sampling, gen)
            yield token
            logits, _ = self.forward([token], cancel)

    def _keep(self, token: int, cancel: threading.Event | None) -> None:
        """A replayed step of `token` is kept: the caller asked for the token after it (unless cancelled)."""
        _check(cancel)
        self.cached.append(token)
