"""Batched decoding: up to max_batch sequences decode in one step (Engine.batch; `run --batch` and the server drive it).

For an offloading engine this is the big lever: a step brings each expert record in once for every sequence that
routes to it, and reads the backbone once for all of them. A sequence joins between steps: its prompt is prefilled
alone in cache slot 0 (the single sequence's slot, with its prompt reuse and prompt cache), its KV rows are copied to
the next free batch slot (1..max_batch), and from then on it decodes in the batch, each sequence at its own position,
with its own sampling, stop strings and cancel event. A sequence that ends leaves at once; the last sequence moves
into its slot, so the batch's slots stay contiguous and attention takes them as one [B, S] block. A step replays a
CUDA graph of its batch size where one captures (runtime/generate/decode_graph.py), else runs eagerly. Greedy tokens
are those of decoding each sequence alone, up to float rounding (tests/runtime/test_batch.py). Legend: B sequences
in the step, V vocab.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from dsfp4.runtime.generate.decode_graph import BATCH_SLOT, DecodeGraphs
from dsfp4.runtime.generate.generation import Delta, Generation
from dsfp4.runtime.generate.sampling import SamplingParams, choose
from dsfp4.runtime.generate.stats import GenerationStats
from dsfp4.runtime.generate.steps import TextSteps
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.runtime.models.position import DevicePosition
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.models.trace_routing import TraceRouting
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.counters import counters_since

# prefill a prompt alone in slot 0, filling its stats' prompt counts -> its logits after the last token [V]
Prefill = Callable[[list[int], threading.Event | None, GenerationStats], torch.Tensor]


@dataclass(eq=False)
class BatchSequence:
    """One sequence of a batch: its prompt, sampling and text state; `deltas` it made since the caller last took them,
    `generation` once it has ended."""

    prompt_ids: list[int]
    sampling: SamplingParams
    gen: torch.Generator | None  # on the model's device: tokens are chosen there
    steps: TextSteps
    cancel: threading.Event | None
    store_before: dict[str, float]  # the expert store's counters when it joined (a batch's shared counters)
    pos: int = 0  # tokens its cache slot holds, the one of a step in flight counted
    token: int = 0  # the token it feeds at the next step launched from the host
    trace_at: int = 0  # under a routing trace: the first row of its stretch (TraceRouting.reserve)
    steps_taken: int = 0  # decode steps it was in, and the sequences in them, summed (for the mean batch size)
    batch_sum: int = 0
    deltas: list[Delta] = field(default_factory=list)
    generation: Generation | None = None

    @property
    def stats(self) -> GenerationStats:
        return self.steps.stats


@dataclass
class Flight:
    """A step launched and not yet read: its sequences in launch order, and its logits [B, V] on the device (valid
    until the next launch)."""

    rows: list[BatchSequence]
    logits: torch.Tensor


class BatchRun:
    """The sequences decoding together in cache slots 1..max_batch of `model`. `prefill` fills slot 0 with a prompt
    (the engine's, with its prompt reuse and prompt cache); `finished` completes a sequence's stats with the
    engine's; `claim` holds the engine while the batch uses it.

    Steps are pipelined where they replay graphs (`pipelined`): each step's tokens are chosen on the device and the
    next step launched with them before the host reads them, so detokenizing and stop strings overlap the device's
    work. A sequence that then turns out to have ended was in that step (its work is discarded), as the single
    sequence's graphs do. Eager steps (experts streamed through fewer slots than a batch needs) run one at a time,
    where such a discarded step would read experts from the SSD for nothing."""

    PIPELINED: bool | None = None  # None: where steps replay graphs; True or False forces it (the tests, on the CPU)

    def __init__(
        self,
        model: Model,
        max_batch: int,
        max_context: int,
        tokenizer: ChatTokenizer,
        claim: Callable[[], AbstractContextManager],
        prefill: Prefill,
        finished: Callable[[GenerationStats], None],
        routing: TraceRouting | None,
        graphs: DecodeGraphs | None,
    ):
        self.model, self.max_batch, self.max_context, self.tokenizer = model, max_batch, max_context, tokenizer
        self.claim, self.prefill, self.finished, self.routing = claim, prefill, finished, routing
        self.slots = [model.positional_caches(i) for i in range(max_batch + 1)]  # each name -> [max_len, ...]
        self.rows: list[BatchSequence] = []  # row i decodes in slot BATCH_SLOT + i
        self.graphs, self.why_eager = graphs, None  # why the last step ran eagerly (None: it replayed a graph)
        self.pipelined = self.PIPELINED
        self.flight: Flight | None = None

    @property
    def free(self) -> int:
        return self.max_batch - len(self.rows)

    @torch.inference_mode()
    def add(self, prompt_ids: list[int], options: RunOptions, cancel: threading.Event | None = None) -> BatchSequence:
        """Prefill a prompt (checked by the caller: Engine.check_prompt) and take its first token; it decodes in the
        batch from the next step, unless that token ended it. Needs a free slot. Cancelled (the cancel event set
        during the prefill) leaves nothing in the batch."""
        assert self.free > 0, "BatchRun.add: every slot is taken"
        n, sampling = len(prompt_ids), options.sampling()
        budget = min(options.max_tokens, self.max_context - n + 1)  # the last token is never fed back
        stats = GenerationStats(prompt_tokens=n)
        steps = TextSteps(self.tokenizer, options.stop, budget, stats, time.perf_counter())
        gen = None if sampling.seed is None else torch.Generator(self.model.device).manual_seed(sampling.seed)
        store = self.model.experts.counters
        seq = BatchSequence(list(prompt_ids), sampling, gen, steps, cancel, store.snapshot())
        with self.claim():
            logits = self.prefill(seq.prompt_ids, cancel, stats)
            seq.pos = n
            if self.routing is not None:  # its decode routes through a stretch of the trace of its own
                seq.trace_at = self.routing.reserve(budget)
            slot = self.slots[BATCH_SLOT + len(self.rows)]
            for name, rows in self.slots[0].items():
                slot[name][:n].copy_(rows[:n])  # after any step in flight: it writes other slots
            self.rows.append(seq)
            self._take(seq, int(choose(logits, sampling, gen)))
            self._drop_finished()
        return seq

    @torch.inference_mode()
    def step(self) -> None:
        """One decode step of every sequence in the batch: each feeds its token and takes the next."""
        if self.rows:
            with self.claim():
                self._step()

    def _step(self) -> None:
        flight = self.flight or self._launch(None)
        chosen = self._choose(flight)  # [B] on the device
        host = torch.empty(len(flight.rows), dtype=torch.long, pin_memory=chosen.is_cuda)
        host.copy_(chosen, non_blocking=True)
        done = torch.cuda.Event() if chosen.is_cuda else None
        if done is not None:
            done.record()
        pipelined = self.why_eager is None if self.pipelined is None else self.pipelined
        self.flight = self._launch((flight.rows, chosen)) if pipelined else None
        if done is not None:
            done.synchronize()  # the tokens, not the step launched after them
        for seq, token in zip(flight.rows, host.tolist(), strict=True):
            if seq.steps.finish is None:
                self._take(seq, token)
        self._drop_finished()

    def _launch(self, carried: tuple[list[BatchSequence], torch.Tensor] | None) -> Flight | None:
        """Launch a step of every sequence -> it, in flight (None when no sequence is left). Each feeds its host token
        or, when `carried` (the sequences of the step before and the tokens chosen for them on the device), that."""
        rows = [s for s in self.rows if s.steps.finish is None]
        if len(rows) != len(self.rows):  # ended ones leave first, so that the slots stay contiguous
            self._drop_finished()
            rows = list(self.rows)
        if not rows:
            return None
        b, device = len(rows), self.model.device
        tokens, positions = [s.token for s in rows], [s.pos for s in rows]
        where = {id(s): j for j, s in enumerate(carried[0])} if carried is not None else {}
        pairs = [(i, where[id(s)]) for i, s in enumerate(rows) if id(s) in where]
        moved = None
        if pairs:  # [C] rows of this step, [C] tokens the last step chose for them
            to_row, from_row = (torch.tensor(x, device=device) for x in zip(*pairs, strict=True))
            moved = (to_row, carried[1].index_select(0, from_row))
        if self.routing is not None:  # each sequence's token takes the next row of its stretch
            self.routing.begin_rows([s.trace_at + s.pos - len(s.prompt_ids) for s in rows])
        self.why_eager = "--no-cuda-graph" if self.graphs is None else self.graphs.why_eager_batch(b)
        if self.why_eager is None:
            logits = self.graphs.batch_step(tokens, positions, moved)  # [B, V]
        else:
            token = torch.tensor(tokens, device=device)
            if moved is not None:
                token.index_copy_(0, *moved)
            where_ = DevicePosition(torch.tensor(positions, device=device), max(positions) + 1, slot=BATCH_SLOT)
            logits = self.model(token.view(b, 1), where_, last_only=True)[0][:, -1]
        for s in rows:
            s.pos += 1
            s.steps_taken += 1
            s.batch_sum += b
        return Flight(rows, logits)

    @staticmethod
    def _choose(flight: Flight) -> torch.Tensor:
        """Each sequence's next token, chosen on the device -> [B] long (greedy ones by one argmax)."""
        chosen = flight.logits.argmax(-1)
        for j, s in enumerate(flight.rows):
            if not s.sampling.greedy:
                chosen[j] = choose(flight.logits[j], s.sampling, s.gen)
        return chosen

    def cancel_all(self) -> None:
        """End every sequence now (finish reason "cancelled")."""
        for seq in self.rows:
            seq.steps.finish = "cancelled"
        self._drop_finished()
        self.flight = None  # what it computed goes nowhere

    def _take(self, seq: BatchSequence, token: int) -> None:
        if seq.cancel is not None and seq.cancel.is_set():
            seq.steps.finish = "cancelled"
            return
        seq.token = token
        if (delta := seq.steps.add(token)) is not None:
            seq.deltas.append(delta)

    def _drop_finished(self) -> None:
        """Sequences that ended leave their slots; the last row moves into each freed one (its rows copied after any
        step in flight, which wrote them in its old slot)."""
        i = 0
        while i < len(self.rows):
            seq = self.rows[i]
            if seq.steps.finish is None:
                i += 1
                continue
            last = self.rows.pop()
            if last is not seq:
                dst, src = self.slots[BATCH_SLOT + i], self.slots[BATCH_SLOT + len(self.rows)]
                for name, rows in src.items():
                    dst[name][: last.pos].copy_(rows[: last.pos])
                self.rows[i] = last
            self._end(seq)

    def _end(self, seq: BatchSequence) -> None:
        steps = seq.steps
        if (last := steps.end()) is not None:
            seq.deltas.append(last)
        stats = steps.stats
        stats.decode_s = time.perf_counter() - steps.start - stats.prefill_s
        mean = seq.batch_sum / seq.steps_taken if seq.steps_taken else 1.0
        how = "CUDA graphs, pipelined" if self.why_eager is None else f"eager: {self.why_eager}"
        stats.decode_mode = f"batch of {mean:.1f} sequences a step on average, {how}"
        stats.store = counters_since(self.model.experts.counters.snapshot(), seq.store_before)  # the batch's, shared
        self.finished(stats)
        seq.generation = Generation(seq.prompt_ids, steps.tokens, steps.text, steps.finish, stats)
