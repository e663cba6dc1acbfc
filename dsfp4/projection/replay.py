"""Replay a routing trace through the expert tiers (GPU slots, RAM cache, SSD) and compare with Belady.

Why: choosing G/R budgets and an eviction policy needs hit rates on real routing, and an optimum to
say how much a better policy could still win. The replay drives the runtime's own SlotPool and
policies with exactly the runtime's access sequence, so its numbers are the runtime's numbers.

A trace is an int array [tokens, layers, top_k] of expert ids, layers being the MoE layers in order.
Each (token, layer) is one step that needs its distinct experts at once; keys are (layer, expert).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from dsfp4.layout.routing_trace import check_ids
from dsfp4.runtime.store.policy import TIER_POLICIES
from dsfp4.runtime.store.slots import SlotPool

# (layer, its distinct keys in routing order, the same keys as a set)
Step = tuple[int, tuple[tuple[int, int], ...], frozenset[tuple[int, int]]]


@dataclass
class TierHits:
    """Where each access was served. accesses = gpu_hits + ram_hits + ssd_reads."""

    accesses: int = 0
    gpu_hits: int = 0
    # not on the GPU, found in RAM
    ram_hits: int = 0
    ssd_reads: int = 0

    def _rate(self, n: int) -> float:
        return n / self.accesses if self.accesses else 0.0

    @property
    def gpu_rate(self) -> float:
        return self._rate(self.gpu_hits)

    @property
    def ram_rate(self) -> float:
        return self._rate(self.ram_hits)

    @property
    def ssd_rate(self) -> float:
        return self._rate(self.ssd_reads)


def _capacity(slots: int, trace: np.ndarray, per_layer: bool, tier: str) -> int:
    """Slots per pool; ValueError when a pool cannot hold one step's top_k experts at once."""
    n_layers, top_k = trace.shape[1], trace.shape[2]
    cap = slots // n_layers if per_layer else slots
    if cap < top_k:
        where = f"{slots} slots // {n_layers} layers = {cap} per layer" if per_layer else f"{cap} slots"
        raise ValueError(f"{tier} tier: {where}, fewer than the {top_k} experts one layer needs at once")
    return cap


def _steps(trace: np.ndarray) -> list[Step]:
    """Steps in runtime order (token-major, layer-minor), each with its distinct keys in routing order."""
    out: list[Step] = []
    for token in trace.tolist():  # [layers][top_k]
        for layer, experts in enumerate(token):
            keys = tuple(dict.fromkeys((layer, e) for e in experts))
            out.append((layer, keys, frozenset(keys)))
    return out


def replay(trace: np.ndarray, gpu_slots: int, ram_slots: int, policy: str = "lru", per_layer: bool = False) -> TierHits:
    """Hits per tier when the runtime serves `trace` with these budgets and this eviction policy.

    Inclusive tiers, as the runtime: a GPU hit also touches the RAM copy; a RAM hit is copied up to a GPU
    slot; an SSD read fills a RAM slot and a GPU slot. Evictions never take a key of the current step.
    (Each tier evicts on its own, so a policy whose ranking depends on capacity, like LFUDecay's
    half-life, can drop from RAM a key the GPU still holds; the replay keeps that behaviour too.)
    per_layer: each layer owns gpu_slots // layers and ram_slots // layers slots instead of sharing pools.
    """
    trace = check_ids(trace)
    return _replay(_steps(trace), trace, gpu_slots, ram_slots, policy, per_layer)


def _replay(
    steps: list[Step], trace: np.ndarray, gpu_slots: int, ram_slots: int, policy: str, per_layer: bool
) -> TierHits:
    """replay() on steps already built from `trace` (compare() builds them once for every run)."""
    if policy not in TIER_POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}: choose one of {sorted(TIER_POLICIES)}")
    gpu_policy, ram_policy = TIER_POLICIES[policy]
    n_layers = trace.shape[1]
    g_cap = _capacity(gpu_slots, trace, per_layer, "GPU")
    r_cap = _capacity(ram_slots, trace, per_layer, "RAM")
    if per_layer:
        gpus = [SlotPool(g_cap, gpu_policy) for _ in range(n_layers)]
        rams = [SlotPool(r_cap, ram_policy) for _ in range(n_layers)]
    else:
        gpus, rams = [SlotPool(g_cap, gpu_policy)] * n_layers, [SlotPool(r_cap, ram_policy)] * n_layers
    n = g = r = s = 0
    for layer, keys, protected in steps:
        gpu, ram = gpus[layer], rams[layer]
        n += len(keys)
        for key in keys:
            if gpu.lookup(key) is not None:
                g += 1
                ram.lookup(key)
                continue
            if ram.lookup(key) is not None:
                r += 1
            else:
                s += 1
                if ram.allocate(key, protected) is None:
                    raise ValueError(f"RAM tier: every slot is protected; capacity below {len(keys)} experts/step")
            if gpu.allocate(key, protected) is None:
                raise ValueError(f"GPU tier: every slot is protected; capacity below {len(keys)} experts/step")
    return TierHits(n, g, r, s)


def _belady_hits(keys: np.ndarray, capacity: int) -> int:
    """Hits of the optimal (furthest next use) cache on steps `keys` [steps, k] of int keys (-1: none).

    A step's keys are needed together, so a miss may not evict another key of the same step: while a
    step runs its keys carry next use = this step, the smallest value in the cache, and become eligible
    only after the step, with their real next use. A heap keyed on -next_use with lazy deletion (an entry
    is live while it matches the cache's value) finds the victim in O(log n).
    """
    n_steps, width = keys.shape
    flat = keys.reshape(-1)
    valid = flat >= 0
    key = flat[valid]  # [accesses]
    step = np.repeat(np.arange(n_steps), width)[valid]  # [accesses]
    # by key, then step
    order = np.lexsort((step, key))
    # never used again: beyond the end
    nxt_sorted = np.full(len(order), n_steps + 1, dtype=np.int64)
    same = key[order][1:] == key[order][:-1]
    nxt_sorted[:-1][same] = step[order][1:][same]
    nxt = np.empty_like(nxt_sorted)
    nxt[order] = nxt_sorted
    bounds = np.concatenate([[0], np.cumsum(valid.reshape(n_steps, width).sum(1))]).tolist()
    key_l, nxt_l = key.tolist(), nxt.tolist()

    # key -> next use
    cache: dict[int, int] = {}
    # (-next use, key), lazily deleted
    heap: list[tuple[int, int]] = []
    hits = 0
    for s in range(n_steps):
        a, b = bounds[s], bounds[s + 1]
        for i in range(a, b):
            k = key_l[i]
            if k in cache:
                hits += 1
                continue
            if len(cache) >= capacity:
                while True:
                    neg, victim = heapq.heappop(heap)
                    if cache.get(victim) == -neg:
                        break
                assert -neg > s, "Belady evicted a key of the current step: capacity below the step's experts"
                del cache[victim]
            cache[k] = s
        for i in range(a, b):
            cache[key_l[i]] = nxt_l[i]
            heapq.heappush(heap, (-nxt_l[i], key_l[i]))
    return hits


def _dedup_rows(keys: np.ndarray) -> np.ndarray:
    """[steps, k] with repeated ids inside a row replaced by -1 (a step needs each expert once)."""
    keys = np.sort(keys, axis=1)
    keys[:, 1:][keys[:, 1:] == keys[:, :-1]] = -1
    return keys


def belady(trace: np.ndarray, gpu_slots: int, ram_slots: int, per_layer: bool = False) -> TierHits:
    """The optimum at these budgets: Belady (evict the furthest next use) per tier.

    With inclusive tiers the GPU's best is Belady at G over the whole access stream, and "not from SSD"
    (GPU + RAM hits) can hold at most R keys, so its best is Belady at R over the same stream; Belady is
    a stack algorithm (its cache at G is inside its cache at R), so one schedule reaches both bounds.
    If ram_slots < gpu_slots the RAM adds nothing under inclusion: the bound is then Belady at G for
    both (ram_hits = 0); a non-inclusive design holding G + R keys could do better than this bound.
    """
    trace = check_ids(trace)
    n_tokens, n_layers, top_k = trace.shape
    g_cap = _capacity(gpu_slots, trace, per_layer, "GPU")
    r_cap = max(_capacity(ram_slots, trace, per_layer, "RAM"), g_cap)
    if per_layer:
        # each [tokens, k]
        streams = [_dedup_rows(trace[:, layer, :].copy()) for layer in range(n_layers)]
    else:
        offset = (np.arange(n_layers, dtype=np.int64) * (int(trace.max()) + 1))[None, :, None]
        streams = [_dedup_rows((trace + offset).reshape(n_tokens * n_layers, top_k))]  # [steps, k]
    accesses = sum(int((s >= 0).sum()) for s in streams)
    hits_g = sum(_belady_hits(s, g_cap) for s in streams)
    hits_r = sum(_belady_hits(s, r_cap) for s in streams) if r_cap > g_cap else hits_g
    return TierHits(accesses, hits_g, hits_r - hits_g, accesses - hits_r)


@dataclass
class Row:
    """One line of the comparison: a policy (or "belady") in a mode, with the optimum beside it."""

    policy: str
    # "global" or "per-layer"
    mode: str
    hits: TierHits | None
    optimum: TierHits | None
    # why the mode could not run (hits and optimum are then None)
    note: str = ""


def compare(
    trace: np.ndarray,
    gpu_slots: int,
    ram_slots: int,
    policies: Sequence[str] = ("lru", "lfu"),
    per_layer: Iterable[bool] = (False, True),
) -> list[Row]:
    """Each policy in each mode, plus Belady's row per mode. A mode whose budgets cannot hold one step
    (slots per pool < top_k) gets a single row with the reason instead of failing the whole table."""
    trace = check_ids(trace)
    steps = _steps(trace)
    rows: list[Row] = []
    for pl in per_layer:
        mode = "per-layer" if pl else "global"
        try:
            opt = belady(trace, gpu_slots, ram_slots, per_layer=pl)
        except ValueError as e:
            rows.append(Row("-", mode, None, None, note=str(e)))
            continue
        for policy in policies:
            rows.append(Row(policy, mode, _replay(steps, trace, gpu_slots, ram_slots, policy, pl), opt))
        rows.append(Row("belady", mode, opt, opt))
    return rows


def table(rows: Sequence[Row]) -> str:
    """Hit rates per tier for each row, with Belady's at the same budgets and SSD reads relative to it."""
    head = ("policy", "mode", "GPU hit %", "RAM hit %", "SSD %", "Belady GPU %", "Belady RAM %", "SSD reads/opt")
    lines = [head]
    for row in rows:
        if row.hits is None or row.optimum is None:
            lines.append((row.policy, row.mode, "n/a: " + row.note))
            continue
        h, o = row.hits, row.optimum
        ratio = f"{h.ssd_reads / o.ssd_reads:.2f}x" if o.ssd_reads else "-"
        pct = [f"{100 * x:.1f}" for x in (h.gpu_rate, h.ram_rate, h.ssd_rate, o.gpu_rate, o.ram_rate)]
        lines.append((row.policy, row.mode, *pct, ratio))
    widths = [max(len(line[i]) for line in lines if len(line) == len(head)) for i in range(len(head))]

    def fmt(line: tuple[str, ...]) -> str:
        # a note runs past the columns
        if len(line) < len(head):
            return f"{line[0].ljust(widths[0])}  {line[1].ljust(widths[1])}  {line[2]}"
        cells = [c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        return "  ".join(cells).rstrip()

    out = [fmt(lines[0]), "  ".join("-" * w for w in widths)] + [fmt(line) for line in lines[1:]]
    return "\n".join(out)
