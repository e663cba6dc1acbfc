"""Prompts prefilled together, layer by layer (`run --batch` with --prompt-cache; Engine.prefill_together).

When experts stream from the SSD a prompt's prefill reads nearly every expert of every layer, so prefilling the lines
of a batch one after another reads the model once per line. Here every prompt goes through layer L before any goes
through L+1 (profile-hot's pass, runtime/profile/profiler.py), so each layer's records are read once for the group,
and each prompt's KV rows of the layer are copied to the host as it leaves it. Each prompt's rows then go into the
prompt cache as an entry, which the line's generation restores instead of prefilling (its last token is fed then,
for its logits). The chunks are ordinary prefill's, so the KV is that of prefilling each prompt alone. A group holds
at most GROUP_TOKENS prompt tokens: their hidden states and KV rows wait in host memory. The MTP layer's caches are
not filled here (its entries are made as generation goes). Legend: S a prompt's tokens but its last.
"""

from __future__ import annotations

import torch

from dsfp4.runtime.generate.prompt_cache import PromptCache
from dsfp4.runtime.models.protocol import Model
from dsfp4.runtime.profile.profiler import layer_pass

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


def _by_layer(caches: dict[str, torch.Tensor]) -> dict[int, list[str]]:
    """The main model's positional caches by block (the MTP layer's left out)."""
    by_layer: dict[int, list[str]] = {}
    for name in caches:
        if (layer := layer_of(name)) is not None:
            by_layer.setdefault(layer, []).append(name)
    return by_layer


def prefill_into_slots(model: Model, prompts: list[list[int]], slots: list[int], chunk: int) -> None:
    """Prefill each prompt layer by layer with the others of its group, its KV rows copied into cache slot slots[k]
    as it leaves each layer (a batch's sequences joining together: runtime/generate/batch.py). The single sequence's
    slot 0 holds no one prompt afterwards."""
    caches = model.positional_caches()  # name -> [max_len, ...] on the device
    by_layer, targets = _by_layer(caches), [model.positional_caches(s) for s in slots]
    for group in groups([len(p) for p in prompts]):

        def keep(layer: int, j: int, group=group) -> None:
            n = len(prompts[group[j]])
            for name in by_layer.get(layer, ()):
                targets[group[j]][name][:n].copy_(caches[name][:n])

        layer_pass(model, [prompts[k] for k in group], chunk, lambda _: None, keep)


def prefill_together(model: Model, cache: PromptCache, prompts: list[list[int]], chunk: int) -> int:
    """Prefill each prompt but its last token, layer by layer with the others of its group, and save its KV rows in
    `cache` -> the tokens prefilled. The model's caches hold no one prompt afterwards."""
    caches = model.positional_caches()  # name -> [max_len, ...] on the device
    by_layer = _by_layer(caches)
    sequences = [p[:-1] for p in prompts]
    for group in groups([len(s) for s in sequences]):
        seqs = [sequences[k] for k in group]
        rows = [{n: torch.zeros((len(s), *t.shape[1:]), dtype=t.dtype) for n, t in caches.items()} for s in seqs]

        def keep(layer: int, j: int, seqs=seqs, rows=rows) -> None:  # [S, ...] rows of the layer's caches
            for name in by_layer.get(layer, ()):
                rows[j][name].copy_(caches[name][: len(seqs[j])])

        layer_pass(model, seqs, chunk, lambda _: None, keep)
        for s, r in zip(seqs, rows, strict=True):
            cache.save(s, r, mtp_upto=0)
    cache.wait()
    return sum(len(s) for s in sequences)
