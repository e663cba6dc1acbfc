"""Sequences through the model one block at a time: a long prompt's prefill where experts stream (decoder.py),
prompts prefilled together (joint_prefill.py) and profile-hot's pass (runtime/profile/profiler.py).

In each block every sequence's tokens go through its attention in order, in pieces of up to `attend` tokens (the
plan's attention_group: a whole number of chunks, so that a call brings the cached keys to the attended form once for
all its tokens), each piece reading the KV rows its earlier pieces wrote there, as ordinary prefill would; then the
block's feed-forward takes the chunks of all the sequences together, in groups of up to `group` tokens (the plan's
prefill_group: what the memory of a chunk's whole forward holds of a group's hidden states), so that each group's
records are brought to the device once, in waves of the device slots, for all its tokens, not once per chunk. The
feed-forward is token by token, so its grouping changes no result but the order in which the waves' fp32 sums add.
Before the block runs, its records are read into the RAM cache where it holds them all, and what fits of the next MoE
layer's behind them. The hidden states wait on the host between blocks, beside the plan's RAM budget, which does not
count them (V3: 14 KB a token).

Legend: T a sequence's tokens, G a group's, D dim (V4's hidden states are its streams, [.., N, D]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dsfp4.runtime.models.protocol import Model


@dataclass(frozen=True)
class Piece:
    """A chunk of sequence `seq`: its tokens [at, at + n)."""

    seq: int
    at: int
    n: int


def chunked(lengths: list[int], chunk: int) -> list[Piece]:
    """Every sequence's chunks of at most `chunk` tokens, sequence after sequence."""
    return [Piece(j, a, min(chunk, n - a)) for j, n in enumerate(lengths) for a in range(0, n, chunk)]


def grouped(pieces: list[Piece], group: int) -> list[list[Piece]]:
    """Consecutive pieces in runs of at most `group` tokens (a longer piece alone)."""
    out: list[list[Piece]] = []
    total = group
    for p in pieces:
        if total + p.n > group:
            out.append([])
            total = 0
        out[-1].append(p)
        total += p.n
    return out


def trace_rows(group: list[Piece], first: list[int]) -> list[int]:
    """A routing trace's rows for a group's tokens, in order: token i of sequence j routes by row first[j] + i."""
    return [first[p.seq] + t for p in group for t in range(p.at, p.at + p.n)]


@dataclass
class LayerPass:
    """What the blocks take: each sequence's tokens [1, T] on the device, the cache position of its first token, its
    hidden states [1, T, ...] on the host (what enters block 0, then what each block gave), the pieces that go
    through attention, and the chunks that go, grouped, through the feed-forward. `routed(pieces)` runs before a
    group's feed-forward (a routing trace's rows for them); `attended(block, j)` once sequence j's pieces have been
    through the block's attention, while the block's caches hold its rows (before the next sequence's overwrite
    them)."""

    tokens: list[torch.Tensor]
    starts: list[int]
    hidden: list[torch.Tensor]
    attention: list[Piece]
    chunks: list[Piece]
    groups: list[list[Piece]]
    routed: Callable[[list[Piece]], None] | None = None
    attended: Callable[[int, int], None] | None = None


@torch.inference_mode()
def prepare(
    model: Model, sequences: list[list[int]], starts: list[int], chunk: int, group: int, attend: int = 0
) -> LayerPass:
    """The pass of `sequences` (sequence j after starts[j] cached positions), embedded a chunk at a time on the device
    and kept on the host (pinned for a GPU); its feed-forward takes `group` tokens at once (0: a chunk's), its
    attention `attend` tokens of a sequence (0: a chunk's)."""
    tokens = [torch.tensor([s], device=model.device) for s in sequences]
    lengths = [len(s) for s in sequences]
    chunks = chunked(lengths, chunk)
    hidden = []
    for j, t in enumerate(tokens):
        mine = [p for p in chunks if p.seq == j]
        for p in mine:
            x = model.embed_tokens(t[:, p.at : p.at + p.n])  # [1, n, ...]
            if p.at == 0:
                # pinned where the device is a GPU: the copies each block makes each way run at the link's speed
                shape = (1, lengths[j], *x.shape[2:])
                hidden.append(torch.empty(shape, dtype=x.dtype, pin_memory=model.device.type == "cuda"))
            hidden[j][:, p.at : p.at + p.n].copy_(x)
    return LayerPass(tokens, starts, hidden, chunked(lengths, attend or chunk), chunks, grouped(chunks, group or chunk))


@torch.inference_mode()
def run_blocks(model: Model, lp: LayerPass) -> Iterator[tuple[int, float]]:
    """Every block on every sequence, one block at a time -> after each piece of work, (the block, the share of it
    done: its attention half of it, 1.0 once done): the caller's moment to report progress or stop (a pass stopped
    inside the blocks leaves caches that hold no sequence whole)."""
    device, work = model.device, 2 * sum(p.n for p in lp.chunks)
    for i, block in enumerate(model.layers):
        if block.moe:
            _read_ahead(model, i)
        done = 0
        for p in lp.attention:
            x = lp.hidden[p.seq][:, p.at : p.at + p.n].to(device, non_blocking=True)  # [1, n, ...]
            lp.hidden[p.seq][:, p.at : p.at + p.n].copy_(model.block_attention(i, x, lp.starts[p.seq] + p.at))
            if lp.attended is not None and p.at + p.n == lp.hidden[p.seq].shape[1]:
                lp.attended(i, p.seq)
            done += p.n
            yield i, done / work
        for g in lp.groups:
            if lp.routed is not None:
                lp.routed(g)
            pieces = [lp.hidden[p.seq][:, p.at : p.at + p.n].to(device, non_blocking=True) for p in g]
            x = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]  # [1, G, ...]
            t = torch.cat([lp.tokens[p.seq][:, p.at : p.at + p.n] for p in g], dim=1)  # [1, G]
            y = model.block_ffn(i, x, t, max(p.n for p in g))
            at = 0
            for p in g:
                lp.hidden[p.seq][:, p.at : p.at + p.n].copy_(y[:, at : at + p.n])
                at += p.n
            done += at
            yield i, done / work


def tokens_done(block: int, share: float, blocks: int, tokens: int) -> int:
    """A pass of `tokens` at run_blocks' (block, share): the tokens it has done, a token done once all `blocks` have
    taken it, counted as the share of (block, token) steps done."""
    return int((block + share) * tokens / blocks)


def _read_ahead(model: Model, layer: int) -> None:
    """The layer's records into the RAM cache where it holds them all, then what fits of the next MoE layer's."""
    store, n = model.experts, model.args.n_routed_experts
    if store.visible:
        return

    def records(i: int) -> list[tuple[int, int]]:
        return sorted(((i, e) for e in range(n)), key=store.manifest.file_position)

    mine = records(layer)
    if len(store.ram_pool.fitting(mine)) < n:
        return
    store.read_ahead(mine, set())
    later = [j for j, block in enumerate(model.layers) if block.moe and j > layer]
    ahead = store.ram_pool.fitting(mine + records(later[0]))[n:] if later else []
    if ahead:
        # this layer's stay
        store.read_ahead(ahead, set(mine))
