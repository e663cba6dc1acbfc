"""Prompts prefilled together, layer by layer (`run --batch` with --prompt-cache; Engine.prefill_together).

When experts stream from the SSD a prompt's prefill reads nearly every expert of every layer, so prefilling the lines
of a batch one after another reads the model once per line. Here every prompt goes through layer L before any goes
through L+1 (layer_pass.py, as a long prompt's prefill and profile-hot's pass), so each layer's records are read once
for the group, and each prompt's KV rows of the layer are copied out as it leaves the layer's attention. Each
prompt's rows then go into the prompt cache as an entry, which the line's generation restores instead of prefilling
(its last token is fed then, for its logits). The chunks are ordinary prefill's, so the KV is that of prefilling each
prompt alone. A group of prompts holds at most GROUP_TOKENS prompt tokens: their hidden states and KV rows wait in
host memory. The MTP layer's caches are not filled here (its entries are made as generation goes). Legend: S a
prompt's tokens but its last.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from dsfp4.runtime.generate.layer_pass import prepare, run_blocks, tokens_done, trace_rows
from dsfp4.runtime.generate.prompt_cache import PromptCache
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.models.trace_routing import TraceRouting

# V3: 16k tokens' hidden states and latent KV rows are about 1.4 GiB of host memory, held beside the plan's RAM budget
# (which does not count them): within the slack a machine keeps beyond it
GROUP_TOKENS = 1 << 14


def groups(lengths: list[int], limit: int = GROUP_TOKENS) -> list[list[int]]:
    """Indices of `lengths` in order, in runs whose lengths sum to at most `limit` (a longer one alone)."""
    out: list[list[int]] = []
    total = limit
    for i, n in enumerate(lengths):
        if total + n > limit:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def layer_of(name: str) -> int | None:
    """The main-model block a positional cache belongs to ('layers.3.attn.kv_cache' -> 3; the MTP layer's: None)."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


# a prompt's rows of the positional caches, by name: each [>= its length, ...]
Rows = dict[str, torch.Tensor]


def _passes(
    model: Model,
    prompts: list[list[int]],
    chunk: int,
    group: int,
    into: Callable[[list[int]], list[Rows]],
    trace: tuple[TraceRouting, list[int]] | None = None,
    between: Callable[[int, int], None] | None = None,
    attend: int = 0,
) -> Iterator[tuple[list[int], list[Rows]]]:
    """Prefill the prompts group by group, each group layer by layer together, its feed-forward `group` tokens at a
    time, its attention `attend` tokens of a prompt (0: a chunk's); into(group) -> where each prompt's KV rows go (its
    first len(prompt) rows of each cache), copied as the prompt leaves each layer's attention -> after each group's
    pass, (the group, its rows). `trace`: (the routing trace, each prompt's first row): prompt k's token i routes by
    row first[k] + i. `between(done, total)`: after each piece of work, the prompts' tokens done (every block having
    taken them) of all of theirs. The single sequence's slot 0 holds no one prompt afterwards."""
    # name -> [max_len, ...] on the device
    caches = model.positional_caches()
    # the main model's caches by block (the MTP layer's left out)
    by_layer: dict[int, list[str]] = {}
    for name in caches:
        if (layer := layer_of(name)) is not None:
            by_layer.setdefault(layer, []).append(name)
    total, before = sum(len(p) for p in prompts), 0
    for members in groups([len(p) for p in prompts]):
        rows = into(members)

        def keep(layer: int, j: int, members=members, rows=rows) -> None:
            n = len(prompts[members[j]])
            for name in by_layer.get(layer, ()):
                rows[j][name][:n].copy_(caches[name][:n])

        lp = prepare(model, [prompts[k] for k in members], [0] * len(members), chunk, group, attend)
        lp.attended = keep
        if trace is not None:
            mine = [trace[1][k] for k in members]
            lp.routed = lambda g, mine=mine: trace[0].begin_rows(trace_rows(g, mine))
        tokens = sum(len(prompts[k]) for k in members)
        for i, share in run_blocks(model, lp):
            if between is not None:
                between(before + tokens_done(i, share, len(model.layers), tokens), total)
        before += tokens
        yield members, rows


def prefill_into_slots(
    model: Model,
    prompts: list[list[int]],
    slots: list[int],
    chunk: int,
    group: int,
    trace: tuple[TraceRouting, list[int]] | None = None,
    between: Callable[[int, int], None] | None = None,
    attend: int = 0,
) -> None:
    """Prefill each prompt layer by layer with the others of its group straight into cache slot slots[k] (a batch's
    sequences joining together: runtime/generate/batch.py); `trace`, `between` and `attend` as _passes takes them."""
    targets = [model.positional_caches(s) for s in slots]
    for _ in _passes(model, prompts, chunk, group, lambda ks: [targets[k] for k in ks], trace, between, attend):
        pass


def prefill_together(
    model: Model, cache: PromptCache, prompts: list[list[int]], chunk: int, group: int, attend: int = 0
) -> int:
    """Prefill each prompt but its last token, layer by layer with the others of its group, and save its KV rows in
    `cache` -> the tokens prefilled. The model's caches hold no one prompt afterwards."""
    caches = model.positional_caches()
    sequences = [p[:-1] for p in prompts]

    def host_rows(members: list[int]) -> list[Rows]:  # [S, ...] each, waiting in host memory
        return [
            {n: torch.zeros((len(sequences[k]), *t.shape[1:]), dtype=t.dtype) for n, t in caches.items()}
            for k in members
        ]

    for members, rows in _passes(model, sequences, chunk, group, host_rows, attend=attend):
        for k, r in zip(members, rows, strict=True):
            cache.save(sequences[k], r, mtp_upto=0)
    cache.wait()
    return sum(len(s) for s in sequences)
