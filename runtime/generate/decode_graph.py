"""CUDA graphs for the decode step: one token through every layer and the head, replayed.

A graph replays kernels with fixed arguments, so nothing inside one may need the host. When the kernels
reach every routed expert by themselves (all on the device, or mapped: the rest read in place from pinned
RAM), a step is one graph. When experts are streamed, each MoE layer's loads need the host (read its
routing, bring the records in): the step is captured in pieces, cut before each such layer's expert
kernel, and a replay runs the loads between the pieces; the kernel then finds the records through the
store's offsets table, refreshed in place. No routing may be recorded, and the device must be CUDA.
The token and its position live in device tensors that a replay reads. Attention in a graph covers a
fixed span of the cache, rows past the position masked out (V3's latent rows; DeepSeek-V4's compressed
entries, its window ring being fixed); spans are powers of two (at least MIN_SPAN, at most the context),
one step each, all captured when the engine starts, in one memory pool. What a replay skips on the host
is done after it: the experts' use counts (when nothing streams), V4's cache position. When a step cannot
be captured it runs eagerly, and `why_eager` says why (it goes into the stats).

A batch's step (B sequences in cache slots BATCH_SLOT.., each at its own position) is captured per batch size and
span on its first use, in the same pool; it replays as long as the store can hold the B K experts it may need at
once (`why_eager_batch`). A batch of greedy sequences launches its next step before the host reads this one's tokens
(batch_ahead): the host's work per row overlaps the device's step.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dsfp4.runtime.generate.card_graphs import Crossing, capture_on, restore, synchronize
from dsfp4.runtime.models.position import DevicePosition
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.models.trace_routing import TraceRouting
from dsfp4.runtime.store.host_lane import abandoned_on_error
from dsfp4.runtime.store.layer_step import LayerAsk
from dsfp4.runtime.store.split_store import fewest_slots

# the shortest attention span captured: short contexts share one graph
MIN_SPAN = 256
# a batch's first cache slot (runtime/generate/batch.py); the single sequence's is 0
BATCH_SLOT = 1


@functools.lru_cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every capture (capture cannot run on the default stream): each new
    stream would get, and keep for the process, a cuBLAS workspace of its own."""
    return torch.cuda.Stream(device)


@dataclass
class CapturedStep:
    """A decode step as graphs: each piece, then the expert loads to run before the next one (None after
    the last), and the last piece's outputs."""

    pieces: list[tuple[torch.cuda.CUDAGraph, LayerAsk | Crossing | None]]
    logits: torch.Tensor  # [B, 1, V]
    hidden: torch.Tensor  # [B, 1, D]
    # each piece's card (a split run's; else the one device)
    devices: list[torch.device]


class DecodeGraphs:
    def __init__(
        self,
        model: Model,
        max_context: int,
        device: torch.device,
        recording: bool,
        routing: TraceRouting | None = None,
    ):
        """routing: a routing trace the MoE layers take their experts from; each replay begins its next row."""
        self.model, self.max_context, self.device, self.routing = model, max_context, device, routing
        # a split run's cards (runtime/generate/card_graphs.py), else the one device
        self.cards = model.cards.cards if model.cards is not None else (device,)
        # (B, first slot, span) -> the step
        self.graphs: dict[tuple[int, int, int], CapturedStep] = {}
        store = model.experts
        # loads between pieces
        self.streamed = store.layout is not None and not store.visible
        self.why_eager = self._why_not(recording)
        # (B, slot) -> [2, B]: tokens and positions
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        # B -> pinned [2, B]: a batch step's tokens and positions
        self.staging: dict[int, torch.Tensor] = {}
        if self.why_eager is None:
            self.token, self.pos = self._inputs(1, 0)
            self.pool = torch.cuda.graph_pool_handle()
            # after the last copy from the pinned staging rows
            self.staged = torch.cuda.Event()
        # V4: every layer, hash-routed ones too
        self.moe = [b.ffn for b in model.layers if b.moe]
        self.moe_layers = [m.layer for m in self.moe]

    def _why_not(self, recording: bool) -> str | None:
        store = self.model.experts
        if self.device.type != "cuda":
            return "CUDA graphs need a CUDA device"
        if self.model.why_eager is not None:
            return self.model.why_eager
        if recording:
            return "routing is being recorded (--record-trace) on the host"
        if self.model.moe_kernel is not None and not self.model.moe_kernel.triton:
            return "Triton is not installed: the experts' torch reference asks the host for its routing"
        k, slots = self.model.args.n_activated_experts, fewest_slots(store)
        if self.streamed and slots < k:
            return f"experts are streamed through {slots} device slots, fewer than a token's {k}"
        return None

    def _inputs(self, b: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device tensors a step of b sequences from cache slot `slot` reads: tokens [B, 1], positions [B] (rows
        of one [2, B] tensor, which a batch step fills from pinned staging in one copy)."""
        if (b, slot) not in self.inputs:
            self.inputs[b, slot] = torch.zeros(2, b, dtype=torch.long, device=self.device)
        both = self.inputs[b, slot]
        return both[0].view(b, 1), both[1]

    def why_eager_batch(self, b: int) -> str | None:
        """Why a batch of b sequences steps eagerly (None: its steps replay)."""
        k, slots = self.model.args.n_activated_experts, fewest_slots(self.model.experts)
        if self.why_eager is None and self.streamed and slots < b * k:
            return f"a batch of {b} may need {b * k} experts at once, more than the {slots} device slots"
        return self.why_eager

    def batch_step(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One step of a batch (runtime/generate/batch.py) by replay: sequence i's token at positions[i] in cache slot
        BATCH_SLOT + i -> logits [B, V] (the caller began its routing trace rows). Its first step of a batch size
        and span captures the step (an untimed run and the capture, then the replay)."""
        self._stage(tokens, positions)
        key = (len(tokens), BATCH_SLOT, self.span(max(positions)))
        if key not in self.graphs:
            self.graphs[key] = self._capture(key, begin=False)
        return self._run(self.graphs[key], len(tokens))[0][:, -1].clone()

    def batch_ahead(self, chosen: torch.Tensor, fed: list[int], positions: list[int]) -> torch.Tensor | None:
        """Launch a batch's next step without the host reading `chosen` (device [N], the last step's tokens, for the
        first N rows): row i feeds fed[i], or chosen[i] where fed[i] is -1, at positions[i] -> the step's logits
        [B, V] (the graph's own, valid until its next replay), or None when its graph is not captured yet (the
        caller steps as usual, capturing it). The caller launches it right after the last step of the same N rows,
        whose inputs are still in place: where the rows stay and every one takes its chosen token, nothing is
        staged on the host (the tokens move device to device and each position steps by one)."""
        key = (len(fed), BATCH_SLOT, self.span(max(positions)))
        if key not in self.graphs:
            return None
        n = len(chosen)
        # the same rows, each taking its chosen token, one position further
        if n == len(fed) and max(fed) < 0:
            # as the last step of this size left them: these rows' tokens
            both = self.inputs[n, BATCH_SLOT]
            both[0].copy_(chosen)
            both[1].add_(1)
        else:
            head = self._stage(fed, positions)[0, :n]
            head.copy_(torch.where(head < 0, chosen, head))
        return self._run(self.graphs[key], len(fed))[0][:, -1]

    def _stage(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """A batch step's tokens and positions into its input rows [2, B], from pinned memory in one copy."""
        b = len(tokens)
        self._inputs(b, BATCH_SLOT)
        both = self.inputs[b, BATCH_SLOT]
        if b not in self.staging:
            self.staging[b] = torch.zeros(2, b, dtype=torch.long, pin_memory=True)
        # the pinned rows' last copy has run (a step launched ahead may still be queued)
        self.staged.synchronize()
        host = self.staging[b]
        host.numpy()[:] = (tokens, positions)
        both.copy_(host, non_blocking=True)
        # on the calling thread's stream, as the copy
        self.staged.record()
        return both

    def span(self, pos: int) -> int:
        """The attention span of a step at `pos`: the smallest power of two above it, within the context."""
        return min(max(MIN_SPAN, 1 << pos.bit_length()), self.max_context)

    def step(self, token: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward of one token at `pos` by graph replay -> (logits [1, 1, V], hidden [1, 1, D])."""
        self.token.fill_(token)
        logits, hidden = self._replay(pos)
        # the next replay overwrites the graph's own outputs
        return logits.clone(), hidden.clone()

    def tokens(
        self,
        logits: torch.Tensor,
        pos: int,
        choose: Callable[[torch.Tensor], torch.Tensor],
        budget: int,
        keep: Callable[[int], None],
    ) -> Iterator[int]:
        """Decode by replay one step ahead of the host, from the logits [V] after the token at pos - 1: each
        token is chosen on the device (choose: logits [V] -> 0-d long) and its step launched before the host
        reads it, so the host's work (detokenizing, stop rules, the caller's) overlaps the device's. At most
        `budget` tokens; keep(token) runs when the caller asks for the next one (the step is then kept).
        A step launched for a token the caller stops at is discarded (its cache row lies past the cached
        tokens), but it ran: the expert counters include it, and closing waits for it, so timings do too."""
        host = torch.empty(1, dtype=torch.long, pin_memory=True)
        chosen = torch.cuda.Event()
        token = choose(logits)
        try:
            for n in itertools.count(1):
                host.copy_(token.view(1), non_blocking=True)
                # on the logits' card (a split run's last), whose stream the copy runs on
                chosen.record(torch.cuda.current_stream(logits.device))
                # the caller stops at the budget's last token: no step for it
                if n < budget:
                    self.token.copy_(token.view(1, 1))
                    logits = self._replay(pos + n - 1)[0][0, -1]
                # the token, not the step launched after it
                chosen.synchronize()
                token_id = int(host[0])
                yield token_id
                keep(token_id)
                token = choose(logits)
        finally:
            synchronize(self.cards)

    def _replay(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the step of the token in self.token at pos -> the graph's own outputs (logits [1, 1, V],
        hidden [1, 1, D]), valid until the next replay. Streamed experts load between the pieces."""
        # all captured by capture_all
        step = self.graphs[1, 0, self.span(pos)]
        self.pos.fill_(pos)
        if self.routing is not None:
            self.routing.begin(1)
        logits, hidden = self._run(step, 1)
        # V4's caches now end after pos (a step the caller discards: reusable knows)
        self.model.replayed(pos)
        return logits, hidden

    def _run(self, step: CapturedStep, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay a captured step of b sequences, streamed experts loaded between its pieces -> its own outputs."""
        waves = None
        for (graph, load), device in zip(step.pieces, step.devices, strict=True):
            with torch.cuda.device(device):
                graph.replay()
            if waves is not None:
                # the wave's slots may be refilled after the piece that computed with them
                next(waves, None)
            waves = None
            if isinstance(load, Crossing):
                load.run()
            elif load is not None:
                waves = self._bring(load)
        # the loads count what streams; here Python skipped the counting
        if not self.streamed:
            self.model.experts.count_resident(self.moe_layers, b * self.model.args.n_activated_experts)
        return step.logits, step.hidden

    def _bring(self, load: LayerAsk) -> Iterator[list[int]]:
        """Run a layer's loads between two pieces (the host waits for the first piece's routing) -> the
        store's waves, left open so that the slots are released after the next piece."""
        store = self.model.experts
        # experts left out have no slot: the next piece reads offset -1
        got = store.step(load)
        with abandoned_on_error(got.job):
            wave = next(got.waves, [])
            on_host = len(got.job.experts) if got.job is not None else 0
            fits = len(wave) + on_host == len(got.chosen)
            assert fits, "a decode step's experts fit the device slots (_why_not says)"
            # the new slots into the table the next piece reads, queued before it
            store.offsets(load.layer)
        if load.lane is not None:
            # the host's sum, queued before the next piece too
            load.lane.fill(got.job)
        return got.waves

    def capture_all(self, max_batch: int = 1) -> None:
        """Capture every span now (at engine start), so that no decode step pays for a capture, and with a batch
        (max_batch > 1) the step of each batch size at the shortest span (a batch's longer spans are captured on
        first use). Each writes cache row 0 of its slots, which a prompt's prefill or a batch's copy overwrites."""
        if not self.ready:
            return
        for b in range(1, max_batch + 1) if max_batch > 1 else ():
            if self.why_eager_batch(b) is None:
                self._inputs(b, BATCH_SLOT)
                key = (b, BATCH_SLOT, self.span(0))
                self.graphs[key] = self._capture(key, begin=False)
        self.token.fill_(0)
        self.pos.fill_(0)
        pos = 0
        # each span covers the positions below it
        while pos < self.max_context:
            span = self.span(pos)
            if (1, 0, span) not in self.graphs:
                self.graphs[1, 0, span] = self._capture((1, 0, span))
            pos = span

    def _capture(self, key: tuple[int, int, int], begin: bool = True) -> CapturedStep:
        """Run the step of key (B, first slot, span) once eagerly (it writes the same cache rows the replay will),
        then capture it: every kernel is compiled by then, so nothing is tuned or built during capture. The eager run
        stays on the current stream. Streamed experts: the capture is cut before each MoE layer's expert kernel
        (MoE.cut), with nothing in flight and the offsets table up to date, so the pieces read it in place. `begin`:
        the capture begins a routing trace row (False: the caller began the batch's rows)."""
        b, slot, span = key
        token, pos = self._inputs(b, slot)
        where, store = DevicePosition(pos, span, slot), self.model.experts
        pieces: list[tuple[torch.cuda.CUDAGraph, LayerAsk | Crossing | None]] = []
        devices: list[torch.device] = [self.device]
        # a split run's cards entered, each one's stream before, and the device current before them
        saved: dict[str, torch.cuda.Stream] = {}
        current = torch.cuda.current_device()

        def begin() -> torch.cuda.CUDAGraph:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            return graph

        def cut(load: LayerAsk) -> torch.Tensor:
            nonlocal graph
            graph.capture_end()
            pieces.append((graph, load))
            graph = begin()
            devices.append(devices[-1])
            return store.offsets(load.layer)

        def cross(h: torch.Tensor, at: DevicePosition, card: int) -> tuple[torch.Tensor, DevicePosition]:
            nonlocal graph
            graph.capture_end()
            device = self.cards[card]
            crossing = Crossing.to(h, at.pos, device)
            pieces.append((graph, crossing))
            capture_on(device, capture_stream(device), saved)
            devices.append(device)
            graph = begin()
            return crossing.h_to, DevicePosition(crossing.pos_to, at.span, at.slot)

        # neither run is a token of a generation
        with store.uncounted():
            if self.routing is not None and begin:
                self.routing.begin(1)
            self.model(token, where, last_only=True)
            if self.streamed:
                store.sync()
                store.offsets(0)
            for device in self.cards:
                torch.cuda.synchronize(device)
            stream = capture_stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                graph = begin()
                for m in self.moe if self.streamed else ():
                    m.cut = cut
                if self.model.cards is not None:
                    self.model.card_cut = cross
                try:
                    logits, hidden = self.model(token, where, last_only=True)
                    graph.capture_end()
                    pieces.append((graph, None))
                finally:
                    for m in self.moe:
                        m.cut = None
                    if self.model.cards is not None:
                        self.model.card_cut = None
                    restore(saved, {str(d): capture_stream(d) for d in self.cards}, current)
            torch.cuda.current_stream(self.device).wait_stream(stream)
        return CapturedStep(pieces, logits, hidden, devices)

    @property
    def pieces(self) -> int:
        """Graphs per captured step: one, or one more than the MoE layers whose experts stream."""
        return len(next(iter(self.graphs.values())).pieces) if self.graphs else 0

    @property
    def ready(self) -> bool:
        return self.why_eager is None
