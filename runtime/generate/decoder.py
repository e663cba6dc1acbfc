"""The decoding core: one sequence through the model. It keeps the tokens whose KV the caches hold, runs forward
passes after them (a captured CUDA graph for one token when one is ready), feeds prompts in chunks and decodes
plainly. The engine and speculative decoding both drive the model through it, and only through it.

Where the routed experts stream (the store does not reach them all without the host), a prompt longer than one chunk
is fed layer by layer: every chunk through block L before any goes through block L+1, so each layer's records are
brought in once for the whole prompt, not once per chunk. A chunk's attention in block L reads the rows its earlier
chunks wrote there, as it would have chunk by chunk: the same computations in another order, the same KV and logits.
The hidden states wait on the host between blocks, beside the plan's RAM budget, which does not count them (V3: 14 KB
a prompt token). A pass cancelled inside the blocks keeps none of its chunks. Where every record is reached in place,
chunks go through all the blocks one after another, as before.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from dsfp4.runtime.generate.decode_graph import DecodeGraphs
from dsfp4.runtime.generate.sampling import SamplingParams, choose, sample
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.models.trace_routing import TraceRouting
from dsfp4.runtime.profile.recorder import RoutingRecorder


class Cancelled(Exception):
    """The caller's cancel event was set: the generation ends at the next chunk or token."""


def by_layer(tokens: int, chunk: int, visible: bool) -> bool:
    """A prompt of `tokens` goes through the model layer by layer (every chunk through a block before the next block)
    where the experts stream (not `visible`: the kernels do not reach every record without the host) and it takes
    more than one chunk; the projection's prefill follows the same rule."""
    return tokens > chunk and not visible


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled


def _embedded(model: Model, tokens: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """tokens [1, T] -> what enters block 0 [1, T, ...] in host memory, embedded a chunk at a time (the device holds
    one chunk's, as the plan's workspace allows)."""
    x = None
    for a, n in spans:
        part = model.embed_tokens(tokens[:, a : a + n]).cpu()
        if x is None:
            x = torch.empty((1, tokens.shape[1], *part.shape[2:]), dtype=part.dtype)
        x[:, a : a + n] = part
    return x


class Decoder:
    """The model, its decode graphs (None: eager steps only), routing recorder (None: not recorded) and routing
    trace (None: the routers route), and the tokens its caches hold (`cached`). Prompts go in chunks of
    `prefill_chunk` tokens."""

    def __init__(
        self,
        model: Model,
        graphs: DecodeGraphs | None,
        recorder: RoutingRecorder | None,
        prefill_chunk: int,
        max_context: int,
        routing: TraceRouting | None = None,
    ):
        self.model, self.graphs, self.recorder, self.routing = model, graphs, recorder, routing
        self.prefill_chunk, self.max_context = prefill_chunk, max_context
        self.cached: list[int] = []
        # (prompt tokens done, of how many) as a feed advances, from (0, n) on: what a progress display reads
        self.progress: Callable[[int, int], None] | None = None

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
        by layer where experts stream and ids take more than one chunk (the module's docstring)."""
        self._advanced(0, len(ids))
        if by_layer(len(ids), self.prefill_chunk, self.model.experts.visible):
            yield from self._feed_by_layer(ids, cancel)
            return
        for i in range(0, len(ids), self.prefill_chunk):
            out = self.forward(ids[i : i + self.prefill_chunk], cancel)
            self._advanced(min(i + self.prefill_chunk, len(ids)), len(ids))
            yield out

    def _advanced(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)

    def _feed_by_layer(
        self, ids: list[int], cancel: threading.Event | None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """feed, every chunk through a block before the next block: yields each chunk's (logits after its last token
        [V], hidden [t, D]) once every block has taken every chunk."""
        model, start, chunk = self.model, len(self.cached), self.prefill_chunk
        spans = [(a, min(chunk, len(ids) - a)) for a in range(0, len(ids), chunk)]
        tokens = torch.tensor([ids], device=model.device)  # [1, T]
        # a trace routes token i of the prompt by the row after the cursor, whichever block runs it
        first = None if self.routing is None else self.routing.reserve(len(ids))
        with self._pass(ids):
            x = _embedded(model, tokens, spans)  # [1, T, D] (V4: [1, T, N, D], its streams) on the host
            blocks = len(model.layers)
            for i in range(blocks):
                for a, n in spans:
                    _check(cancel)
                    if first is not None:
                        self.routing.begin_rows(list(range(first + a, first + a + n)))
                    part = model.block_step(i, x[:, a : a + n].to(model.device), start + a, tokens[:, a : a + n])
                    x[:, a : a + n] = part.to(x.device)
                    # a token is done once every block has taken it: the share of (block, token) steps done
                    self._advanced((i * len(ids) + a + n) // blocks, len(ids))
        for a, n in spans:
            logits, h = model.finish(x[:, a : a + n].to(model.device), start + len(ids), last_only=True)
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
    ) -> Iterator[int]:
        """Plain decoding: prefill ids after the cached tokens, then yield tokens. Replayed steps run one ahead
        of the host (DecodeGraphs.tokens, sampling on the device); eager ones feed a token to the model only
        when the next one is asked for (so the last one never is)."""
        logits = self.prefill(ids, cancel)
        if self.replays:
            seed = sampling.seed
            on_device = None if seed is None else torch.Generator(self.model.device).manual_seed(seed)
            start = len(self.cached)
            yield from self.graphs.tokens(
                logits, start, lambda x: choose(x, sampling, on_device), budget, lambda t: self._keep(t, cancel)
            )
            return
        while True:
            token = sample(logits, sampling, gen)
            yield token
            logits, _ = self.forward([token], cancel)

    def _keep(self, token: int, cancel: threading.Event | None) -> None:
        """A replayed step of `token` is kept: the caller asked for the token after it (unless cancelled)."""
        _check(cancel)
        self.cached.append(token)
