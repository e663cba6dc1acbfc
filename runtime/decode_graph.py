"""CUDA graphs for the decode step: one token through every layer and the head, replayed as one graph.

A graph replays kernels with fixed arguments, so a step can be captured only when nothing in it needs the
host: the kernels reach every routed expert the run uses by themselves (all on the device, or mapped: the
rest read in place from pinned RAM), so the MoE layers never ask the store to load one; no routing is
recorded, and the device is CUDA. The token and its position live in device tensors that a replay
reads. Attention in a graph covers a fixed span of the cache, rows past the position masked out (V3's
latent rows; DeepSeek-V4's compressed entries, its window ring being fixed); spans are powers of two (at
least MIN_SPAN, at most the context), one graph each, all captured when the engine starts, in one memory
pool. What a replay skips on the host is done after it: the experts' use counts, V4's cache position.
When a step cannot be captured it runs eagerly, and `why_eager` says why (it goes into the stats).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import torch

from dsfp4.runtime.attention import DevicePosition
from dsfp4.runtime.model import Transformer
from dsfp4.runtime.model_v4 import TransformerV4

MIN_SPAN = 256  # the shortest attention span captured: short contexts share one graph


class DecodeGraphs:
    def __init__(self, model: Transformer | TransformerV4, max_context: int, device: torch.device, recording: bool):
        self.model, self.max_context, self.device = model, max_context, device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.why_eager = self._why_not(recording)
        if self.why_eager is None:
            self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
            self.pos = torch.zeros(1, dtype=torch.long, device=device)
            self.pool = torch.cuda.graph_pool_handle()
        self.moe_layers = [b.ffn.layer for b in model.layers if b.moe]  # V4: every layer, hash-routed ones too

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
        if store.layout is not None and not store.visible:
            return (
                f"experts are streamed ({store.plan.gpu_slots} of {store.plan.total_records} records fit on "
                f"the device, {store.plan.ram_slots} in RAM), so each layer waits for the host"
            )
        return None

    def span(self, pos: int) -> int:
        """The attention span of a step at `pos`: the smallest power of two above it, within the context."""
        return min(max(MIN_SPAN, 1 << pos.bit_length()), self.max_context)

    def step(self, token: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's forward of one token at `pos` by graph replay -> (logits [1, 1, V], hidden [1, 1, D])."""
        self.token.fill_(token)
        logits, hidden = self._replay(pos)
        return logits.clone(), hidden.clone()  # the next replay overwrites the graph's own outputs

    def tokens(
        self, logits: torch.Tensor, pos: int, choose: Callable[[torch.Tensor], torch.Tensor], budget: int,
        keep: Callable[[int], None],
    ) -> Iterator[int]:  # fmt: skip
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
                chosen.record()
                if n < budget:  # the caller stops at the budget's last token: no step for it
                    self.token.copy_(token.view(1, 1))
                    logits = self._replay(pos + n - 1)[0][0, -1]
                chosen.synchronize()  # the token, not the step launched after it
                token_id = int(host[0])
                yield token_id
                keep(token_id)
                token = choose(logits)
        finally:
            torch.cuda.current_stream(self.device).synchronize()

    def _replay(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the step of the token in self.token at pos -> the graph's own outputs (logits [1, 1, V],
        hidden [1, 1, D]), valid until the next replay."""
        graph, logits, hidden = self.graphs[self.span(pos)]  # all captured by capture_all
        self.pos.fill_(pos)
        graph.replay()
        self.model.experts.count_resident(self.moe_layers, self.model.args.n_activated_experts)  # Python skipped
        if isinstance(self.model, TransformerV4):
            self.model.pos = pos + 1  # its caches now end after pos (a step the caller discards: reusable knows)
        return logits, hidden

    def capture_all(self) -> None:
        """Capture every span now (at engine start), so that no decode step pays for a capture. Each writes
        cache row 0, which the first prompt's prefill overwrites."""
        if not self.ready:
            return
        self.token.fill_(0)
        self.pos.fill_(0)
        pos = 0
        while pos < self.max_context:  # each span covers the positions below it
            span = self.span(pos)
            if span not in self.graphs:
                self.graphs[span] = self._capture(span)
            pos = span

    def _capture(self, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        """Run the step once eagerly (it writes the same cache row the replay will), then capture it: every
        kernel is compiled by then, so nothing is tuned or built during capture. The eager run stays on the
        current stream: each new stream would get (and keep, for the process) its own cuBLAS workspace."""
        where = DevicePosition(self.pos, span)
        with self.model.experts.uncounted():  # neither run is a token of a generation
            self.model(self.token, where, last_only=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits, hidden = self.model(self.token, where, last_only=True)
        return graph, logits, hidden

    @property
    def ready(self) -> bool:
        return self.why_eager is None
