"""Batched decoding: up to max_batch sequences decode in one step (Engine.batch; `run --batch` and the server drive it).

For an offloading engine this is the big lever: a step brings each expert record in once for every sequence that
routes to it, and reads the backbone once for all of them. A sequence joins between steps: its prompt is prefilled
alone in cache slot 0 (the single sequence's slot, with its prompt reuse and prompt cache), its KV rows are copied to
the next free batch slot (1..max_batch), and from then on it decodes in the batch, each sequence at its own position,
with its own sampling, stop strings and cancel event. Where every record is on the device a short prompt skips the
prefill: the batch's steps feed it a token each, beside the others' tokens, so a join no longer stalls the batch.
A sequence that ends leaves at once; the last sequence moves into its slot, so the batch's slots stay contiguous and
attention takes them as one [B, S] block. A step replays a CUDA graph of its batch size where one captures
(runtime/generate/decode_graph.py), else runs eagerly. Greedy tokens are those of decoding each sequence alone, up to
float rounding (tests/runtime/test_batch.py). A batch of greedy sequences runs one step ahead of the host, as a single
sequence does: each step's tokens feed the next step on the device before the host reads them. The host knows the
next step's rows and the tokens it does not choose (a prompt's next token, a joining prompt's first) before it reads
this step's, so joins and prompts being fed keep the step ahead: a stepped prompt joins at the next step boundary
(`joining`), in the step launched then. A row that ends by its length, or whose cancel is set, launches nothing
ahead. What the host cannot foresee discards the step launched: an end by a stop string or EOS, a cancel set while
it ran, a prompt prefilled into the batch (it ran, and the expert counters include it; `discarded` counts them).
Legend: B sequences in the step, V vocab.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from dsfp4.runtime.generate.decode_graph import BATCH_SLOT, DecodeGraphs
from dsfp4.runtime.generate.generation import Delta, Generation
from dsfp4.runtime.generate.joint_prefill import prefill_into_slots
from dsfp4.runtime.generate.logits_rules import TokenRules, pick
from dsfp4.runtime.generate.sampling_params import SamplingParams
from dsfp4.runtime.generate.stats import GenerationStats
from dsfp4.runtime.generate.steps import TextSteps
from dsfp4.runtime.generate.tokenizer import ChatTokenizer
from dsfp4.runtime.models.position import DevicePosition
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.models.trace_routing import TraceRouting
from dsfp4.runtime.options import RunOptions
from dsfp4.runtime.store.counters import counters_since

# where every record is on the device a prompt this short joins through the batch's steps (Engine.batch): a prefill of
# its own cost many steps' time in launches, while the batch waited (docs/BENCHMARKS.md, resident batches)
STEPPED_PROMPT_TOKENS = 32

# prefill a prompt alone in slot 0, filling its stats' prompt counts -> its logits after the last token [V]
Prefill = Callable[[list[int], threading.Event | None, GenerationStats], torch.Tensor]


@dataclass(frozen=True)
class Hooks:
    """What a batch asks of its engine."""

    # hold the engine while the batch uses it
    claim: Callable[[], AbstractContextManager]
    # one prompt into slot 0, as a generation's (prompt reuse, prompt cache)
    prefill: Prefill
    # slot 0 no longer holds what the engine thinks it does
    forget: Callable[[], None]
    # the engine's part of an ended sequence's stats
    finished: Callable[[GenerationStats], None]
    # while the block runs, the single sequence's prefill calls this where it may stop (Decoder.pause; None: nowhere)
    pausing: Callable[[Callable[[], None] | None], AbstractContextManager]
    # a sequence's logits rules from its options and prompt (penalties, log-probabilities, grammar; None: none)
    rules: Callable[[RunOptions, list[int]], TokenRules | None] = lambda options, ids: None


@dataclass(eq=False)
class BatchSequence:
    """One sequence of a batch: its prompt, sampling and text state; `deltas` it made since the caller last took them,
    `generation` once it has ended."""

    prompt_ids: list[int]
    sampling: SamplingParams
    gen: torch.Generator | None
    steps: TextSteps
    cancel: threading.Event | None
    # the expert store's counters when it joined (a batch's shared counters)
    store_before: dict[str, float]
    # tokens its cache slot holds
    pos: int = 0
    # the token it feeds at the next step
    token: int = 0
    # under a routing trace: the first row of its stretch (TraceRouting.reserve)
    trace_at: int = 0
    # decode steps it was in, and the sequences in them, summed (for the mean batch size)
    steps_taken: int = 0
    batch_sum: int = 0
    deltas: list[Delta] = field(default_factory=list)
    generation: Generation | None = None
    # prompt tokens still to feed after `token` (stepped prompts)
    feed: deque[int] = field(default_factory=deque)
    # what it does to its logits (logits_rules.py); None: nothing, its tokens may be chosen on the device
    rules: TokenRules | None = None

    @property
    def argmax(self) -> bool:
        """Its token is the raw logits' argmax, which the device may take for the whole batch."""
        return self.sampling.greedy and self.rules is None

    @property
    def stats(self) -> GenerationStats:
        return self.steps.stats

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


class BatchRun:
    """The sequences decoding together in cache slots 1..max_batch of `model`, with the engine's `hooks`. With `joint`
    (the engine's choice) prompts that join together prefill layer by layer together (add_many). Prompts of up to
    `stepped` tokens (the engine's choice) join without a prefill: the batch's steps feed them a token a step. A
    joining prompt's prefill pauses for a step of the running sequences whenever `yield_s` seconds have passed since
    their last (0: never), and `on_step` (the caller's) then runs, to send the tokens that step made; `progress`
    (the caller's) gets a joint prefill's (tokens done, of how many), as Decoder.progress gets a single one's."""

    def __init__(
        self,
        model: Model,
        max_batch: int,
        max_context: int,
        prefill_chunk: int,
        tokenizer: ChatTokenizer,
        hooks: Hooks,
        routing: TraceRouting | None,
        graphs: DecodeGraphs | None,
        joint: bool = False,
        stepped: int = 0,
        yield_s: float = 0.0,
    ):
        self.model, self.max_batch, self.max_context, self.chunk = model, max_batch, max_context, prefill_chunk
        self.yield_s, self.stepped_at = yield_s, time.perf_counter()
        self.on_step: Callable[[], None] | None = None
        self.progress: Callable[[int, int], None] | None = None
        # steps run inside a joining prompt's prefill (its pauses)
        self.paused_steps = 0
        self.tokenizer, self.hooks, self.routing = tokenizer, hooks, routing
        # each name -> [max_len, ...]
        self.slots = [model.positional_caches(i) for i in range(max_batch + 1)]
        # row i decodes in slot BATCH_SLOT + i
        self.rows: list[BatchSequence] = []
        # why the last step ran eagerly (None: it replayed a graph)
        self.graphs, self.why_eager = graphs, None
        self.joint, self.stepped = joint, stepped
        # stepped prompts that join at the next step boundary
        self.joining: list[BatchSequence] = []
        # ahead: (the rows it runs, their tokens on the device [B]); used only if the rows are still those
        self.ahead: tuple[list[BatchSequence], torch.Tensor] | None = None
        # steps launched ahead and not used: the rows changed, or the batch was cancelled
        self.discarded = 0
        # trace rows are begun by the host: no step ahead
        if graphs is not None and graphs.ready and routing is None:
            self.chosen = torch.empty(max_batch, dtype=torch.long, pin_memory=True)
            self.copied = torch.cuda.Event()

    @property
    def free(self) -> int:
        return self.max_batch - len(self.rows) - len(self.joining)

    @property
    def busy(self) -> bool:
        """Sequences decode or wait to join at the next step."""
        return bool(self.rows or self.joining)

    def _sequence(self, prompt_ids: list[int], options: RunOptions, cancel: threading.Event | None) -> BatchSequence:
        n, sampling = len(prompt_ids), options.sampling()
        rules = self.hooks.rules(options, list(prompt_ids))
        # the last token is never fed back
        budget = min(options.max_tokens, self.max_context - n + 1)
        stats, logprobs = GenerationStats(prompt_tokens=n), rules.logprobs if rules is not None else None
        steps = TextSteps(self.tokenizer, options.stop, budget, stats, time.perf_counter(), logprobs)
        gen = torch.Generator().manual_seed(sampling.seed) if sampling.seed is not None else None
        store = self.model.experts.counters.snapshot()
        return BatchSequence(list(prompt_ids), sampling, gen, steps, cancel, store, rules=rules)

    @torch.inference_mode()
    def add(self, prompt_ids: list[int], options: RunOptions, cancel: threading.Event | None = None) -> BatchSequence:
        """Prefill a prompt (checked by the caller: Engine.check_prompt) and take its first token; it decodes in the
        batch from the next step, unless that token ended it. Needs a free slot. Cancelled (the cancel event set
        during the prefill) leaves nothing in the batch. A prompt of up to `stepped` tokens is not prefilled: it
        joins the rows at the next step, and the steps feed it (its first token comes from the step of its last)."""
        assert self.free > 0, "BatchRun.add: every slot is taken"
        seq = self._sequence(prompt_ids, options, cancel)
        n = len(prompt_ids)
        # its prompt goes through the next steps, a token each, beside the others' tokens
        if n <= self.stepped:
            seq.token, seq.feed = prompt_ids[0], deque(prompt_ids[1:])
            self.joining.append(seq)
            return seq
        with self.hooks.claim(), self.hooks.pausing(self._pause if self.yield_s else None):
            logits = self.hooks.prefill(seq.prompt_ids, cancel, seq.stats)
            seq.pos = n
            self._reserve(seq)
            _copy_rows(self.slots[BATCH_SLOT + len(self.rows)], self.slots[0], n)
            self._discard()
            self.rows.append(seq)
            self._take(seq, pick(seq.rules, logits, seq.sampling, seq.gen))
            self._drop_finished()
        return seq

    @torch.inference_mode()
    def add_many(self, requests: list[tuple[list[int], RunOptions, threading.Event | None]]) -> list[BatchSequence]:
        """Prompts joining at once (as `add`'s arguments). With `joint`, those of 2 tokens or more prefill layer by
        layer together straight into their slots (joint_prefill.prefill_into_slots: each layer's records read once
        for all of them, not once each), all but their last tokens, which the next step feeds; else one by one."""
        assert len(requests) <= self.free, "BatchRun.add_many: more prompts than free slots"
        together = {i: r for i, r in enumerate(requests) if len(r[0]) >= 2} if self.joint else {}
        if len(together) < 2:
            return [self.add(*r) for r in requests]
        seqs = {i: self._sequence(*r) for i, r in together.items()}
        with self.hooks.claim():
            # the pass leaves slot 0 holding no one prompt
            self.hooks.forget()
            first = BATCH_SLOT + len(self.rows)
            prompts = [seq.prompt_ids[:-1] for seq in seqs.values()]
            # under a trace each prompt routes through a stretch of rows of its own, as its decode will
            trace = (self.routing, [self.routing.reserve(len(p)) for p in prompts]) if self.routing else None
            slots, plan = list(range(first, first + len(prompts))), self.model.experts.plan
            prefill_into_slots(
                self.model,
                prompts,
                slots,
                self.chunk,
                plan.prefill_group,
                trace,
                self._joint_progress,
                attend=plan.attention_group,
            )
            for seq in seqs.values():
                seq.pos, seq.token = len(seq.prompt_ids) - 1, seq.prompt_ids[-1]
                self._reserve(seq)
                self._discard()
                self.rows.append(seq)
        return [seqs[i] if i in seqs else self.add(*r) for i, r in enumerate(requests)]

    def _pause(self) -> None:
        """A joining prompt's prefill may stop here: a step of the running sequences once yield_s has passed since
        their last (their slots are not the prefill's), and the caller's on_step."""
        if not self.rows or time.perf_counter() - self.stepped_at < self.yield_s:
            return
        self._step()
        self.paused_steps += 1
        if self.on_step is not None:
            self.on_step()

    def _joint_progress(self, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress(done, total)
        if self.yield_s and 0 < done < total:
            self._pause()

    def _reserve(self, seq: BatchSequence) -> None:
        # its decode routes through a stretch of the trace of its own
        if self.routing is not None:
            seq.trace_at = self.routing.reserve(seq.steps.budget)

    @torch.inference_mode()
    def step(self) -> None:
        """One decode step of every sequence in the batch: each feeds its token and takes the next."""
        if self.busy:
            with self.hooks.claim():
                self._step()

    def _step(self) -> None:
        ahead, self.ahead = self.ahead, None
        # this step already runs on the device
        launched = ahead is not None and ahead[0] == self.rows
        if not launched:
            self._join()
        b, device, positions = len(self.rows), self.model.device, [s.pos for s in self.rows]
        self.why_eager = "--no-cuda-graph" if self.graphs is None else self.graphs.why_eager_batch(b)
        # rows whose token is the raw argmax; the others go through their rules or sample, on the host
        greedy = [s.argmax for s in self.rows]
        if launched:
            best = self._ahead(ahead[1], positions)
        else:
            # each sequence's token takes the next row of its stretch
            if self.routing is not None:
                self.routing.begin_rows([s.trace_at + s.steps_taken for s in self.rows])
            tokens = [s.token for s in self.rows]
            if self.why_eager is None:
                logits = self.graphs.batch_step(tokens, positions)  # [B, V]
            else:
                pos = torch.tensor(positions, device=device)  # [B]
                where = DevicePosition(pos, max(positions) + 1, slot=BATCH_SLOT)
                logits = self.model(torch.tensor(tokens, device=device).view(b, 1), where, last_only=True)[0][:, -1]
            if all(greedy) and self.why_eager is None and self.routing is None:
                best = self._ahead(logits.argmax(-1), positions)
            else:
                # one host sync for every greedy sequence
                best = logits.argmax(-1).tolist() if any(greedy) else []
        for i, seq in enumerate(self.rows):
            seq.pos += 1
            # a stepped prompt: the step only filled its cache row
            if seq.feed:
                seq.token = seq.feed.popleft()
                if seq.cancelled:
                    seq.steps.finish = "cancelled"
                continue
            seq.steps_taken += 1
            seq.batch_sum += b
            self._take(seq, best[i] if greedy[i] else pick(seq.rules, logits[i], seq.sampling, seq.gen))
        self._drop_finished()
        # those in the step launched ahead, if one was
        self._join()
        self.stepped_at = time.perf_counter()

    def _discard(self) -> None:
        """The rows change: a step launched ahead for the old ones is of no use (it ran all the same)."""
        if self.ahead is not None:
            self.ahead, self.discarded = None, self.discarded + 1

    def _join(self) -> None:
        self.rows += self.joining
        self.joining = []

    def _ahead(self, chosen: torch.Tensor, positions: list[int]) -> list[int]:
        """This step's greedy tokens (chosen: device [B]) to the host; before reading them, the next step launched
        where the host knows its rows and the tokens it does not choose (kept in self.ahead for the next call)."""
        b = len(positions)
        self.chosen[:b].copy_(chosen, non_blocking=True)
        self.copied.record()
        if (following := self._following()) is not None:
            rows, fed, at = following
            logits = self.graphs.batch_ahead(chosen, fed, at)
            if logits is not None:
                self.ahead = (rows, logits.argmax(-1))
        # this step's tokens, not the step launched after them
        self.copied.synchronize()
        return self.chosen[:b].tolist()

    def _following(self) -> tuple[list[BatchSequence], list[int], list[int]] | None:
        """The next step's rows, the tokens the host gives them (-1: the token this step chooses) and their positions,
        or None where the host cannot know them yet: a row that may sample, or one this step ends (by its length, or
        cancelled already)."""
        rows = self.rows + self.joining
        if not all(s.argmax for s in rows) or self.graphs.why_eager_batch(len(rows)) is not None:
            return None
        if any(s.cancelled for s in rows) or any(not s.feed and s.steps.last_is_next for s in self.rows):
            return None
        fed = [s.feed[0] if s.feed else -1 for s in self.rows] + [s.token for s in self.joining]
        at = [s.pos + 1 for s in self.rows] + [s.pos for s in self.joining]
        return (rows, fed, at) if max(at) < self.max_context else None

    def cancel_all(self) -> None:
        """End every sequence now (finish reason "cancelled")."""
        self._join()
        for seq in self.rows:
            seq.steps.finish = "cancelled"
        self._drop_finished()

    def _take(self, seq: BatchSequence, token: int) -> None:
        if seq.cancelled:
            seq.steps.finish = "cancelled"
            return
        seq.token = token
        if (delta := seq.steps.add(token)) is not None:
            seq.deltas.append(delta)

    def _drop_finished(self) -> None:
        """Sequences that ended leave their slots; the last row moves into each freed one."""
        i = 0
        while i < len(self.rows):
            seq = self.rows[i]
            if seq.steps.finish is None:
                i += 1
                continue
            self._discard()
            last = self.rows.pop()
            if last is not seq:
                _copy_rows(self.slots[BATCH_SLOT + i], self.slots[BATCH_SLOT + len(self.rows)], last.pos)
                self.rows[i] = last
            self._end(seq)

    def _end(self, seq: BatchSequence) -> None:
        steps = seq.steps
        if (last := steps.end()) is not None:
            seq.deltas.append(last)
        stats = steps.stats
        stats.decode_s = time.perf_counter() - steps.start - stats.prefill_s
        mean = seq.batch_sum / seq.steps_taken if seq.steps_taken else 1.0
        how = "CUDA graphs" if self.why_eager is None else f"eager: {self.why_eager}"
        stats.decode_mode = f"batch of {mean:.1f} sequences a step on average, {how}"
        # the batch's, shared
        stats.store = counters_since(self.model.experts.counters.snapshot(), seq.store_before)
        self.hooks.finished(stats)
        seq.generation = Generation(
            seq.prompt_ids, steps.tokens, steps.text, steps.finish, stats, steps.kept_logprobs()
        )


def _copy_rows(dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor], n: int) -> None:
    """A sequence's first n rows of every positional cache, from one cache slot (src) to another (dst)."""
    for name, rows in src.items():
        dst[name][:n].copy_(rows[:n])
