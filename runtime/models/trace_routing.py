"""Routing from a trace: each MoE layer takes a routing trace's experts and weights for the tokens it computes
instead of its router's choice, so the expert store, prefetch, kernels and CUDA graphs run under that routing on
any model (a random bench model's router routes nothing like a trained DeepSeek).

- Tokens: every forward pass of T tokens takes the trace's next T rows; the trace wraps around at its end. A pass
  the caller discards (a decode step launched ahead for a token it stopped at) has used its rows too. In a batch
  (runtime/generate/batch.py) each sequence decodes through a stretch of rows of its own (`reserve`).
- Layers: the model's MoE layer j of M takes the trace's layer floor(j * L / M) of L: spread over the trace, its
  first layer first (M = L maps one to one).
- Weights: the trace's (.npz, after route_scale), else route_scale / K each, what renormalised top-K routing
  gives experts of equal score.
- The router still runs, so a step keeps its cost; its choice is replaced.
- Prefetch: a router cannot predict a trace's next layer, so the guess for the next MoE layer is the trace's own
  row there, each expert kept with probability `recall` and else replaced by a random expert it did not choose
  (K guesses: precision equals recall). Seeded by the trace position, so runs repeat.

The rows a pass needs sit in device buffers that `begin` fills before each pass (eager or replayed graph): a
captured decode step reads them in place. Legend: N trace tokens, L trace layers, M model MoE layers, K top-k.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dsfp4.errors import ConfigError
from dsfp4.layout.routing_trace import read_trace
from dsfp4.runtime.models.protocol import Model

# passes whose rows may be in flight at once (decode graphs run one step ahead of the host)
STAGING = 4


def guesses(truth: np.ndarray, recall: float, n_experts: int, rng: np.random.Generator) -> np.ndarray:
    """A prefetcher's guesses of routing `truth` [..., K]: each id kept with probability recall, else an expert
    outside its row's truth (so precision equals recall)."""
    keep = rng.random(truth.shape) < recall
    out = truth.copy()
    for idx in zip(*np.nonzero(~keep), strict=True):
        row = truth[idx[:-1]]
        while (g := int(rng.integers(n_experts))) in row:
            pass
        out[idx] = g
    return out


class TraceRouting:
    def __init__(
        self,
        path: Path,
        moe_layers: list[int],
        n_experts: int,
        top_k: int,
        route_scale: float,
        device: torch.device,
        max_tokens: int,
        recall: float = 1.0,
        seed: int = 0,
    ):
        if not 0.0 <= recall <= 1.0:
            raise ConfigError(f"--routing-recall {recall}: give a share of the next layer's experts, 0 to 1")
        trace = read_trace(path)
        n, n_layers, k = trace.ids.shape
        if k < top_k:
            raise ConfigError(f"{path}: {k} experts per token, the model routes {top_k}; record a trace of this shape")
        if int(trace.ids.max()) >= n_experts:
            raise ConfigError(f"{path}: expert id {int(trace.ids.max())}, the model has {n_experts} routed experts")
        self.path, self.recall, self.seed = Path(path), recall, seed
        self.moe_layers, self.n_experts = list(moe_layers), n_experts
        m = len(self.moe_layers)
        self.trace_layers = [j * n_layers // m for j in range(m)]
        self.ids = trace.ids[:, self.trace_layers, :top_k]  # [N, M, K]
        if trace.weights is not None:
            self.weights = trace.weights[:, self.trace_layers, :top_k].astype(np.float32)
        else:
            self.weights = np.full(self.ids.shape, route_scale / top_k, dtype=np.float32)
        self.row = {layer: j for j, layer in enumerate(self.moe_layers)}
        shape, pin = (m, max_tokens, top_k), device.type == "cuda"
        self.ids_now = torch.zeros(shape, dtype=torch.int64, device=device)  # [M, T, K]: the pass's rows
        self.weights_now = torch.zeros(shape, dtype=torch.float32, device=device)
        # row j: a guess of layer j + 1's
        self.guess_now = torch.zeros(shape, dtype=torch.int64, device=device)
        # pinned staging, a few passes deep: a copy queued behind a running step must not see its source rewritten
        self._staging = [
            tuple(torch.zeros(shape, dtype=t.dtype, pin_memory=pin) for t in (self.ids_now, self.weights_now))
            + (torch.zeros(shape, dtype=torch.int64, pin_memory=pin),)
            for _ in range(STAGING)
        ]
        # when each staging slot's copy ran
        self._copied: list[torch.cuda.Event | None] = [None] * STAGING
        self.cursor, self.passes = 0, 0

    def describe(self) -> str:
        """Which trace ran, and which prefetcher: for the stats."""
        n, _, k = self.ids.shape
        return (
            f"trace {self.path.name} ({n} tokens; MoE layers take trace layers {self.trace_layers}), "
            f"prefetch guesses from the trace at recall {self.recall:.2f}"
        )

    def begin(self, t: int) -> None:
        """The next t tokens' rows into the device buffers, before a pass of t tokens runs."""
        rows = (self.cursor + np.arange(t)) % len(self.ids)  # [T]
        self.cursor = (self.cursor + t) % len(self.ids)
        self._load(rows)

    def reserve(self, n: int) -> int:
        """A batched sequence's own stretch of n rows, from the cursor on (later passes and sequences take the rows
        after it) -> its first row. Each sequence of a batch then routes like a stretch of the trace, as a real
        sequence's tokens route like each other, and unlike the others' stretches."""
        first = self.cursor
        self.cursor = (self.cursor + n) % len(self.ids)
        return first

    def begin_rows(self, rows: list[int]) -> None:
        """A batch step: token b of the pass takes trace row rows[b] (its sequence's next, reserve)."""
        self._load(np.asarray(rows, dtype=np.int64) % len(self.ids))

    def _load(self, rows: np.ndarray) -> None:
        """Trace rows [T] into the device buffers, before a pass of T tokens runs."""
        t = len(rows)
        if t > self.ids_now.shape[1]:
            raise ConfigError(f"a pass of {t} tokens under a routing trace: at most {self.ids_now.shape[1]}")
        ids, weights = self.ids[rows].swapaxes(0, 1), self.weights[rows].swapaxes(0, 1)  # [M, T, K]
        slot = self.passes % STAGING
        if self._copied[slot] is not None:
            # its last copy has read the slot (the host ran STAGING passes ahead)
            self._copied[slot].synchronize()
        ids_h, weights_h, guess_h = self._staging[slot]
        ids_h[:, :t] = torch.from_numpy(np.ascontiguousarray(ids))
        weights_h[:, :t] = torch.from_numpy(np.ascontiguousarray(weights))
        rng = np.random.default_rng([self.seed, int(rows[0])])
        guess_h[:-1, :t] = torch.from_numpy(guesses(ids[1:], self.recall, self.n_experts, rng))
        for now, host in ((self.ids_now, ids_h), (self.weights_now, weights_h), (self.guess_now, guess_h)):
            # in stream order: after the step that read them
            now[:, :t].copy_(host[:, :t], non_blocking=True)
        if self.ids_now.is_cuda:
            self._copied[slot] = torch.cuda.Event()
            self._copied[slot].record()
        self.passes += 1

    def route(self, layer: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K], ids [T, K]) of `layer` for the pass begun."""
        j = self.row[layer]
        return self.weights_now[j, :t], self.ids_now[j, :t]

    def guess(self, layer: int, t: int) -> torch.Tensor:
        """The guess of `layer`'s experts [T, K], made while the MoE layer before it runs."""
        return self.guess_now[self.row[layer] - 1, :t]


def attach(model: Model, routing: TraceRouting) -> None:
    """Every MoE layer of the model's main layers routes by `routing`, and guesses its next MoE layer's experts
    from it (the MTP block keeps its router)."""
    moe = [b.ffn for b in model.layers if b.moe]
    for m in moe:
        m.trace = routing
        if m.next_router is not None:
            nxt = m.next_router[0]
            m.next_router = (nxt, lambda h, tokens, nxt=nxt: routing.guess(nxt, h.shape[0] * h.shape[1]))
