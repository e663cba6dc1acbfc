"""A streamed layer's prefill wave as compacted calls: only the (token, slot) pairs whose expert the wave brought to
the device, each a "token" of one choice, over the wave's experts renumbered 0..S-1 (runtime/models/moe.py
MoE._streamed takes them above decode's token count).

A wave of S of a layer's E experts holds about S / E of a step's pairs. Called over a chunk's tokens with all their
ids, the prefill kernel would skip the others' pairs, having planned its tiles for the mean rows of all E experts
(prefill.prefill_blocks: 16 an expert at a 512-token chunk of DeepSeek-V3, where its GEMMs run at a third of their
rate at 128 rows); compacted, its tiles follow the experts' real rows. The pairs go to the kernel by expert, in runs
that a chunk's workspace holds (expert_runs): a run spans the few experts whose pairs fill it, so a wave of most of
a layer's experts still gives each the rows a group of tokens routes to it, not a run's share of all of them. Each
pair's output row is then added to its token's row of an fp32 sum, a token's pairs by their place among its present
pairs (in slot order): one add's rows belong to distinct tokens, so each row takes one fp32 add and the sum is the
same bits on every run. What the runs index is planned on the host from the step's choices, copied there once a step
(StepChoices), so the host queues a wave while the device computes the one before.

Legend: T tokens, D dim, K choices a token, E routed experts, S the wave's experts with pairs, P the wave's pairs,
R a run's (at most run_pairs of the experts it spans).
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch

from dsfp4.kernels.backend import upload
from dsfp4.kernels.moe.decode import MAX_TOKENS
from dsfp4.kernels.moe.kernel import MoEKernel, workspace_bytes
from dsfp4.kernels.moe.prefill import prefill_blocks
from dsfp4.layout.record import RecordLayout
from dsfp4.layout.record_offsets import ABSENT

FP32 = 4
# Triton specializes an int argument divisible by this, and one equal to 1 (a run of one pair), as constants
SPECIALIZED_DIVISOR = 16


def compacts(tokens: int, piece: int | None) -> bool:
    """Whether a streamed step of `tokens` tokens, through the kernel `piece` tokens at a time (None: all at once),
    takes compacted waves: where a piece's call is a prefill call, whose workspace bounds the runs (run_pairs)."""
    return min(tokens, piece or tokens) > MAX_TOKENS


@dataclass(frozen=True)
class StepChoices:
    """A streamed step's choices on the host, copied once a step (one wait for the device, not two a wave): ids
    [T, K]; by_expert [T * K], the pairs t * K + j by expert, tokens ascending within one (a token chooses an expert
    once); experts [T * K], the expert of each of them; counts [E], each of the layer's E experts' pairs."""

    ids: np.ndarray
    by_expert: np.ndarray
    experts: np.ndarray
    counts: np.ndarray

    @classmethod
    def of(cls, ids: np.ndarray, n_experts: int) -> StepChoices:
        flat = ids.reshape(-1)
        # a radix sort where the experts' ids fit 16 bits
        order = np.argsort(flat.astype(np.uint16) if n_experts <= 1 << 16 else flat, kind="stable")
        return cls(ids, order, flat[order], np.bincount(flat, minlength=n_experts))


@dataclass(frozen=True)
class WavePairs:
    """A wave's present pairs, planned on the host: pairs [P], the pairs t * K + j whose expert is in the wave, by
    expert and in token order within one (as the runs take them); place [P], each one's place among its token's
    present pairs (in slot order); counts, each of the layer's E experts' pairs among them."""

    pairs: np.ndarray
    place: np.ndarray
    counts: list[int]


def in_wave(experts: list[int], n_experts: int) -> np.ndarray:
    """[E] bool: the wave's experts (the store's list of them)."""
    present = np.zeros(n_experts, dtype=bool)
    present[experts] = True
    return present


def present_pairs(step: StepChoices, present: np.ndarray) -> WavePairs | None:
    """step: the step's choices, present: [E] bool, the wave's experts -> its WavePairs; None where every pair is
    present (nothing to skip: the chunk's own calls)."""
    counts = np.where(present, step.counts, 0)  # [E]
    if counts.sum() == step.experts.size:
        return None
    pairs = step.by_expert[present[step.experts]]  # [P]
    # a pair's place: its token's choices before it that the wave holds
    place = np.cumsum(present[step.ids], axis=1, dtype=np.int8).reshape(-1)[pairs] - 1  # [P]
    return WavePairs(pairs, place, counts.tolist())


# (first pair, end pair, first expert, end expert) of a run
Run = tuple[int, int, int, int]


def expert_runs(counts: list[int], cap: Callable[[int], int]) -> list[Run]:
    """counts: the pairs of each of a wave's experts (each > 0, in expert order), cap(s): the most pairs a call over s
    experts takes -> the runs (first pair, end pair, first expert, end expert) over the pairs sorted by
    expert: consecutive spans, each as long as cap of the experts it spans allows; an expert whose pairs a run cannot
    hold whole goes on in the next; a run holds at least one pair."""
    runs, start, first, pos = [], 0, 0, 0
    for e, c in enumerate(counts):
        while c:
            room = cap(e - first + 1) - (pos - start)
            if room <= 0 and pos > start:
                runs.append((start, pos, first, e))
                start, first = pos, e
                continue
            take = min(c, max(room, 1))
            pos, c = pos + take, c - take
            if c:
                runs.append((start, pos, first, e + 1))
                start, first = pos, e
    if pos > start:
        runs.append((start, pos, first, len(counts)))
    return runs


def _rows_a_call(runs: list[Run], pairs: int, top_k: int, n_experts: int, piece: int) -> tuple[float, bool]:
    """(rows an expert has in a call of these runs of `pairs` pairs, whether that beats a piece's call over all the
    layer's experts, piece * K / E rows: whether the wave compacts); the piece's figure where it does not."""
    compacted = pairs / max(1, sum(end - first for _, _, first, end in runs))
    whole = piece * top_k / n_experts
    return (compacted, True) if compacted > whole else (whole, False)


def call_rows(
    layout: RecordLayout,
    top_k: int,
    n_experts: int,
    piece: int,
    present: int,
    pairs: float,
    dtype: torch.dtype,
    mma: bool,
) -> tuple[float, bool]:
    """(rows an expert has in a call of a wave of `present` of `n_experts` experts holding `pairs` pairs, in equal
    shares, whether it takes compacted calls): compacted where its expert_runs give an expert more rows a call than a
    piece's call over all the experts does (piece * K / E); a wave of few pairs spread over many experts can give
    fewer, and then keeps the piece's calls. The projection's form of wave_runs and gains."""
    present, total = max(present, 1), max(1, round(pairs))
    counts = [c for c in (total // present + (e < total % present) for e in range(present)) if c]
    runs = expert_runs(counts, lambda s: run_pairs(layout, top_k, n_experts, piece, s, dtype, mma))
    return _rows_a_call(runs, total, top_k, n_experts, piece)


def wave_runs(kernel: MoEKernel, wave: WavePairs, piece: int, dtype: torch.dtype) -> list[Run]:
    """The expert_runs of a wave's present pairs (piece: its step's tokens a call), over the experts that have
    pairs, each within run_pairs of those it spans."""
    e = len(wave.counts)
    return expert_runs(
        [c for c in wave.counts if c], lambda s: run_pairs(kernel.layout, kernel.top_k, e, piece, s, dtype, kernel.mma)
    )


def gains(kernel: MoEKernel, wave: WavePairs, runs: list[Run], piece: int) -> bool:
    """Whether a wave's present pairs take compacted calls in these runs (wave_runs) rather than a piece's calls."""
    return _rows_a_call(runs, len(wave.pairs), kernel.top_k, len(wave.counts), piece)[1]


@functools.cache
def run_pairs(
    layout: RecordLayout, top_k: int, n_experts: int, piece: int, present: int, dtype: torch.dtype, mma: bool
) -> int:
    """The most pairs a compacted call over `present` experts takes: at most a piece's piece * top_k, and no more
    than keep what it holds within a piece's call's, which the plan's workspace holds (runtime/plan/workspace.py
    counts kernel.workspace_bytes at a chunk; a piece is at most one).

    kernel.workspace_bytes(layout, 1, S, R) counts a call of R tokens of one choice: the expert rows, each expert's
    run padded to whole blocks (prefill.max_blocks: every expert short of a block), the R pair rows, and 2 R rows
    for the result and its sum with the shared experts' output, which a compacted call does not add: its gathered
    input [R, D] takes that room (and MXFP8 codes of it and of the expert rows where the FP4 MMA runs, as a
    token's). Its count can pass a piece's: the piece's [piece * K, D] pair rows come with only 2 piece rows beside
    them, where R pair rows come with 2 R (their results and gathered input); and few experts take larger blocks. So
    the runs stop at the count's limit: DeepSeek-V3 at 512-token chunks keeps 1,894 to 2,749 of the piece's 4,096
    pairs (tested).
    Within one tile size the count grows with the pairs (max_blocks does), and the tiles grow with them (at most
    BLOCK_M_RANGE's four sizes), so a bisection per tile size finds the limit; a call of up to MAX_TOKENS pairs,
    which the count takes for decode's, is counted as one of MAX_TOKENS + 1 (no more expert rows, fewer pairs)."""
    budget = workspace_bytes(layout, top_k, n_experts, piece, dtype, mma)

    def rows(r: int) -> int:
        return prefill_blocks(r, present, layout).rows

    def over(r: int) -> bool:
        return workspace_bytes(layout, 1, present, max(r, MAX_TOKENS + 1), dtype, mma) > budget

    most, lo = piece * top_k, 1
    while lo <= most:
        # the last count of lo's tile size
        hi = lo + bisect.bisect_right(range(lo, most + 1), rows(lo), key=rows) - 1
        if over(hi):
            return lo + bisect.bisect_left(range(lo, hi + 1), True, key=over) - 1
        lo = hi + 1
    return most


def add_wave(
    kernel: MoEKernel,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    offsets: torch.Tensor,
    wave: WavePairs,
    runs: list[Run],
    y: torch.Tensor | None,
) -> torch.Tensor:
    """x: [T, D], ids: [T, K], weights: [T, K], records: the slot pool, offsets: the wave's [E], wave: its
    present_pairs, runs: its wave_runs -> y [T, D] fp32, the waves' sum so far (None: zeros; added to in place where
    fp32) with this wave's pairs added, run by run. Nothing waits for the device: what the runs index is planned on
    the host and copied up at once, so the host queues the next wave while the device computes this one."""
    t, k = ids.shape
    y = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device) if y is None else y.float()
    # a wave none of whose experts a token chose (the CPU lane took them all) adds nothing
    if not wave.pairs.size:
        return y
    sizes = np.asarray(wave.counts)
    have = np.flatnonzero(sizes)  # [S] the wave's experts with pairs
    # each pair's expert renumbered in expert order, so that the tiles see their rows
    local = np.repeat(np.arange(have.size), sizes[have])  # [P]
    # each run's rows by place (tokens ascending within one: a radix sort of small keys), and the rows of each place
    placed = [np.argsort(wave.place[a:b], kind="stable") for a, b, _, _ in runs]
    by_place = [np.bincount(wave.place[a:b], minlength=k).tolist() for a, b, _, _ in runs]
    index = upload(torch.from_numpy(np.concatenate([have, wave.pairs, local, *placed])), ids.device)
    p = wave.pairs.size
    have_ids, pairs, local, placed = torch.split(index, [have.size, p, p, p])
    wave_offsets = offsets[have_ids]  # [S]
    tokens = pairs // k  # [P]
    chosen = weights.flatten()[pairs].view(-1, 1)  # [P, 1]
    for (a, b, first, end), places in zip(runs, by_place, strict=True):
        run = slice(a, b)
        own = (local[run] - first).view(-1, 1)  # [R, 1]: the run's experts renumbered from 0
        out = kernel.prefill(x[tokens[run]], own, chosen[run], records, wave_offsets[first:end])  # [R, D]
        add_rows(y, tokens[run], placed[run], out, places)
    return y


def add_rows(y: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, counts: list[int]) -> None:
    """y [T, D] fp32 += out [R, D] row by row into rows tokens [R], in the order `rows` [R]: first every pair's of
    place 0, then of place 1 ... (counts: the rows of each place). One add's tokens are distinct, so each row takes
    one fp32 add (the same bits however the device orders them) and each token's rows add in slot order. An add's
    temporaries (out's rows, and in fp32) take at most the room of the call's pair rows and gathered input, both
    freed (run_pairs)."""
    most = max(1, 2 * out.shape[0] * out.element_size() // (out.element_size() + FP32))
    at = 0
    for n in counts:
        for b in range(at, at + n, most):
            seg = slice(b, min(b + most, at + n))
            y.index_add_(0, tokens[rows[seg]], out[rows[seg]].float())
        at += n


def wave_sizes(max_pairs: int, variant: Callable[[int], Hashable]) -> list[int]:
    """One pair count per distinct variant(p) for calls of 1..max_pairs pairs (the smallest of each), ascending."""
    sizes: dict[Hashable, int] = {}
    for p in range(1, max_pairs + 1):
        sizes.setdefault(variant(p), p)
    return sorted(sizes.values())


def wave_variant(layout: RecordLayout) -> Callable[[int], Hashable]:
    """p -> what the prefill kernels compile for a compacted call of p pairs over one expert: the tiles, and Triton's
    specialization of the pair count. A call over s experts takes the tiles of a mean of p / s rows, those of fewer
    pairs over one expert; and each tile size meets pair counts of every class there (a multiple of 16, one, other)
    wherever a call over more experts can (tests/kernels/test_moe_waves.py checks every (p, s) of DeepSeek-V3's)."""
    return lambda p: (prefill_blocks(p, 1, layout), p % SPECIALIZED_DIVISOR == 0, p == 1)


def warm_up_waves(kernel: MoEKernel, dtype: torch.dtype, records: torch.Tensor, max_tokens: int) -> int:
    """Compile every variant a compacted call of a step of up to max_tokens tokens a call can take (the engine's
    start, where experts stream: MoEKernel.warm_up compiles the chunks' own) -> the calls made (0 where no Triton
    kernel runs). No expert is read: the one expert is left out."""
    if not kernel.triton:
        return 0
    device = records.device
    offsets = torch.full((1,), ABSENT, dtype=torch.long, device=device)
    sizes = wave_sizes(max_tokens * kernel.top_k, wave_variant(kernel.layout))
    for p in sizes:
        x = torch.zeros(p, kernel.layout.dim, dtype=dtype, device=device)
        ids = torch.zeros(p, 1, dtype=torch.long, device=device)
        kernel.prefill(x, ids, torch.zeros(p, 1, device=device), records, offsets)
    return len(sizes)
