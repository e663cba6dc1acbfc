"""The planner of a run split across the cards of one box (--devices): the decoder layers cut into runs, one run a
card, by bytes, each card's share within its own budget; the RAM tier and the SSD are the one machine's.

A card holds its layers' backbone and caches, its own RoPE tables and a forward's workspace, and expert slots for its
MoE layers' records only; the first card the embedding, the last the final norm, the head and the MTP layer. The cut
maximizes the expert slots per MoE layer of the card with the fewest (the store's hit rate follows slots per layer):
the largest whole number of slots per layer for which the layers, taken in order, fill card after card within their
budgets (a binary search); each card then gets every slot its budget leaves. The hidden state crosses a cut once per
forward pass (V3: 14 KB a token in bf16).

A split keeps the whole backbone on the cards (no host backbone: a card short of it is refused, naming the bytes).
"""

from __future__ import annotations

import dataclasses

import torch

from dsfp4.errors import ConfigError
from dsfp4.kernels.kernel_paths import kernel_paths
from dsfp4.layout.manifest import Manifest
from dsfp4.runtime.plan.budget import Budgets, GiB
from dsfp4.runtime.plan.cards import CardShare
from dsfp4.runtime.plan.host_backbone import EMBED, HostBackbone, layer_bytes, tensor_bytes
from dsfp4.runtime.plan.planner import (
    COMPLEX64,
    DeviceTier,
    Plan,
    cache_slots,
    expert_layers,
    layer_cache_bytes,
    ram_tier,
    run_needs,
)
from dsfp4.runtime.plan.workspace import attention_group, prefill_group
from dsfp4.units import format_bytes

# host memory each CUDA card's context takes beyond the first's (its libraries are loaded once): an estimate until
# measured on a two-GPU machine
CARD_HOST_RESERVE = GiB


@dataclasses.dataclass(frozen=True)
class _Layers:
    """Bytes of the split's parts: each block's backbone and caches (`sizes`; `weights` of it its backbone), whether it
    is an MoE layer with records; what every card holds (RoPE tables, a forward's workspace) and what the first
    (the embedding; on the CPU the process too: `host`) and the last (final norm, head) hold besides."""

    sizes: dict[int, int]
    weights: dict[int, int]
    moe: dict[int, bool]
    rope: int
    workspace: int
    embed: int
    head: int
    host: int
    record: int
    top_k: int

    def fixed(self, c: int, k: int) -> int:
        """Bytes card c of k holds besides its layers and expert slots."""
        return self.rope + self.workspace + (self.embed + self.host) * (c == 0) + self.head * (c == k - 1)


def _slot_need(m: int, s: int, top_k: int) -> int:
    """Slots a card of m MoE layers needs at s slots per layer: at least a token's top_k, where it has any."""
    return max(s * m, top_k) if m else 0


def _fits(parts: _Layers, budget: int, fixed: int, layers: list[int], s: int) -> bool:
    m = sum(parts.moe[i] for i in layers)
    return fixed + sum(parts.sizes[i] for i in layers) + _slot_need(m, s, parts.top_k) * parts.record <= budget


def _cut(parts: _Layers, budgets: tuple[int, ...], main: list[int], mtp: list[int], s: int) -> list[list[int]] | None:
    """The main layers in order, card after card while each fits at s slots per MoE layer (the MTP layers on the
    last card) -> each card's layers, or None when they do not all fit."""
    k = len(budgets)
    out: list[list[int]] = [[] for _ in range(k)]
    c = 0
    for i in main:
        # the last card holds the MTP layers too
        while c < k and not _fits(parts, budgets[c], parts.fixed(c, k), [*out[c], i, *mtp * (c == k - 1)], s):
            c += 1
        if c == k:
            return None
        out[c].append(i)
    out[-1] += mtp
    # a card left without layers still holds its fixed part (the first: the embedding)
    return out if all(_fits(parts, budgets[c], parts.fixed(c, k), out[c], s) for c in range(k)) else None


def split_layers(parts: _Layers, budgets: tuple[int, ...], main: list[int], mtp: list[int], n_experts: int) -> list:
    """The cut with the most slots per MoE layer (module docstring) -> each card's layers; a ConfigError naming the
    bytes when not even a token's experts fit beside the layers."""
    if _cut(parts, budgets, main, mtp, 0) is None:
        k = len(budgets)
        need = sum(parts.sizes.values()) + sum(parts.fixed(c, k) for c in range(k))
        raise ConfigError(
            f"--devices: the cards' budgets {' + '.join(format_bytes(b) for b in budgets)} cannot hold this model's "
            f"layers, caches and on each card a forward's workspace ({format_bytes(need)} in all, "
            f"{format_bytes(parts.fixed(1, k + 1))} of it each card's) with a token's {parts.top_k} expert slots on "
            "each; a split "
            "keeps the backbone on the cards: give larger --gpu-mem sizes, lower --max-context or --prefill-chunk, "
            "or convert with --backbone fp4"
        )
    lo, hi = 0, n_experts
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _cut(parts, budgets, main, mtp, mid) is not None else (lo, mid - 1)
    return _cut(parts, budgets, main, mtp, lo)


def _parts(manifest: Manifest, elt: int, max_context: int, slots: int, used: range, workspace: int) -> _Layers:
    a = manifest.args
    weights = layer_bytes(manifest, elt, used)
    caches = {i: slots * sum(layer_cache_bytes(a, i, max_context, elt)) for i in used}
    records = set(expert_layers(manifest, with_mtp=True))
    embed = tensor_bytes(EMBED, manifest.tensors[EMBED], elt) if EMBED in manifest.tensors else 0
    rest = [n for n in manifest.tensors if not n.startswith("layers.") and n != EMBED]
    head = sum(tensor_bytes(n, manifest.tensors[n], elt) for n in rest)
    rope = a.family_spec.rope_tables * max_context * (a.qk_rope_head_dim // 2) * COMPLEX64
    record = manifest.record.nbytes if manifest.record else 0
    return _Layers(
        {i: weights[i] + caches[i] for i in used},
        weights,
        {i: i in records and record > 0 for i in used},
        rope,
        workspace,
        embed,
        head,
        0,
        record,
        a.n_activated_experts if record else 0,
    )


def make_split_plan(
    manifest: Manifest,
    cards: list[torch.device],
    dtype: torch.dtype,
    budgets: Budgets,
    max_context: int,
    prefill_chunk: int,
    io_threads: int,
    with_mtp: bool = False,
    host_extra: int = 0,
    process: int | None = None,
    max_batch: int = 1,
    kernels: bool | None = None,
    fp8_attention: bool = False,
) -> Plan:
    """make_plan for a split across `cards` (budgets.cards: each card's, resolved): the cut (split_layers), each
    card's share, then the one RAM tier. `kernels`: whether the Triton and FP8 kernels run (default: the first
    card's kernel_paths; a projection's user cards run them); `fp8_attention` as make_plan's."""
    a, elt, first = manifest.args, torch.empty((), dtype=dtype).element_size(), cards[0]
    paths = kernel_paths(first)
    kernels, fp8 = (paths.kernels, paths.fp8_kernels) if kernels is None else (kernels, kernels)
    shape = (max_context, prefill_chunk, with_mtp, host_extra, process)
    n = run_needs(manifest, first, dtype, *shape, kernels, fp8, max_batch, fp8_attention)
    distinct = {str(c) for c in cards if c.type == "cuda"}
    n = dataclasses.replace(n, host_base=n.host_base + CARD_HOST_RESERVE * max(len(distinct) - 1, 0))
    used = range(a.n_blocks if with_mtp else a.n_layers)
    parts = _parts(manifest, elt, max_context, cache_slots(max_batch), used, n.workspace)
    if first.type == "cpu":
        # both tiers are host memory: the process and the mapping are counted on the first card
        parts = dataclasses.replace(parts, host=n.host_base)
    main, mtp = [i for i in used if i < a.n_layers], [i for i in used if i >= a.n_layers]
    split = split_layers(parts, budgets.cards, main, mtp, a.n_routed_experts)
    shares = _shares(cards, budgets.cards, split, parts, a.n_routed_experts)
    tier = DeviceTier(HostBackbone(), 0, 0, sum(c.gpu_slots for c in shares))
    staging, ram_slots, cold_slots, cold = ram_tier(
        manifest, first, budgets, n, expert_layers(manifest, with_mtp), tier, io_threads, max_context
    )
    return Plan(
        ",".join(str(c) for c in cards),
        budgets,
        sum(c.backbone for c in shares),
        sum(c.kv_cache for c in shares),
        n.workspace,
        n.record,
        tier.gpu_slots,
        ram_slots,
        staging,
        n.host_base,
        n.total_records,
        expert_layers(manifest, with_mtp),
        max_batch=max_batch,
        cold_slots=cold_slots,
        cold_record=cold,
        prefill_group=prefill_group(a, prefill_chunk, max_context, elt),
        attention_group=attention_group(a, prefill_chunk, max_context, elt, kernels, fp8_attention),
        cards=shares,
    )


def _shares(
    cards: list[torch.device], budgets: tuple[int, ...], split: list[list[int]], parts: _Layers, n_experts: int
) -> tuple[CardShare, ...]:
    """Each card's share of the cut: its bytes, and the slots its budget leaves (at most its records)."""
    k, out = len(cards), []
    for c, layers in enumerate(split):
        moe = tuple(i for i in layers if parts.moe[i])
        records = len(moe) * n_experts
        room = budgets[c] - parts.fixed(c, k) - sum(parts.sizes[i] for i in layers)
        slots = max(min(room // parts.record, records), 0) if parts.record else 0
        backbone = sum(parts.weights[i] for i in layers) + parts.embed * (c == 0) + parts.head * (c == k - 1)
        kv = sum(parts.sizes[i] - parts.weights[i] for i in layers) + parts.rope
        out.append(
            CardShare(str(cards[c]), budgets[c], tuple(layers), backbone, kv, parts.workspace, slots, records, moe)
        )
    return tuple(out)
