"""A prompt's prefill simulated through the store's tiers (simulate.py's Tiers), as `dsfp4 run` prefills it: chunk by
chunk through the layers, or, where experts stream, layer by layer for all its chunks (runtime/generate/layer_pass.py),
each layer step's distinct experts in waves of the store's wave_size: all of them where the device slots hold them,
else half the slots a wave, device hits first, then RAM's, then the SSD's; a wave's reads start as the wave before it
computes, and its copies wait for the compute of the wave before that to free the slots."""

from __future__ import annotations

import numpy as np

from dsfp4.kernels.moe.waves import compacts
from dsfp4.projection.simulate import PREFILL_TILE_ROWS, HostStream, Key, Links, Projection, StepCosts, Tiers
from dsfp4.runtime.generate.decoder import by_layer
from dsfp4.runtime.store.waves import wave_size

# nothing of the backbone read over PCIe
NO_HOST_STREAM = HostStream()


def simulate_prefill(
    trace: np.ndarray,
    gpu_slots: int,
    ram_slots: int,
    record_bytes: int,
    links: Links,
    costs: StepCosts,
    chunk: int,
    policy: str = "hot",
    warm: list[Key] = (),
    host: HostStream = NO_HOST_STREAM,
    decode_steps: bool = False,
    group: int = 0,
    context_s: np.ndarray | None = None,
) -> Projection:
    """Prefill the prompt whose routing is `trace` [P, L, K] in chunks of `chunk` tokens through pools of gpu_slots
    and ram_slots records (`costs` per token, compute-bound: a chunk of n tokens costs n times as much; `warm` as
    for simulate; `host` too, its bytes read once per PREFILL_TILE_ROWS tokens) -> the prompt's totals, `seconds`
    the time to its first token. The chunks go through the layers in the decoder's order (by_layer): where experts
    stream, every chunk through a layer before the next layer, the layer's experts brought once per `group` tokens
    (the plan's prefill_group; 0: a chunk's), as layer_pass.py runs them, each layer's records read ahead as its pass
    reaches it (_read_ahead). `context_s` [P]: the seconds of attention
    of a prompt token at each position (against the keys before it) in each MoE layer, beside costs.attn_s (None:
    none). `decode_steps`: the chunks are a batch's decode steps instead (MachineRun.decode_batch), each needing the
    token of the one before: one after another."""
    n_tokens, n_layers, top_k = trace.shape
    tiers = Tiers(gpu_slots, ram_slots, record_bytes, links, policy, warm, gpu_slots + top_k)
    out = tiers.out
    out.tokens = n_tokens
    context_s = np.zeros(n_tokens) if context_s is None else context_s[:n_tokens]
    visible = gpu_slots >= n_layers * (int(trace.max()) + 1)
    layered = not decode_steps and by_layer(n_tokens, chunk, visible)
    size = (group or chunk) if layered else chunk
    # (first row, its routing rows [n, L, K])
    blocks = [(first, trace[first : first + size]) for first in range(0, n_tokens, size)]
    if layered:
        steps = [(layer, first, rows) for layer in range(n_layers) for first, rows in blocks]
    else:
        steps = [(layer, first, rows) for first, rows in blocks for layer in range(n_layers)]
    now, n_experts = 0.0, int(trace.max()) + 1
    for layer, first, rows in steps:
        if layered and first == 0:
            _read_ahead(tiers, layer, n_layers, n_experts, now)
        if layered:
            # the tokens' hidden states come from pinned RAM and go back, behind the copies queued
            now = tiers.stream(now, len(rows) * host.hidden_bytes, 0.0)
        attn_s = float(context_s[first : first + len(rows)].sum())
        now = _prefill_layer(tiers, rows, layer, now, costs, host, gpu_slots, chunk, attn_s)
        if layer == n_layers - 1:
            # the dense layers and the head, once the chunk has been through every MoE layer
            now = tiers.stream(now, -(-len(rows) // PREFILL_TILE_ROWS) * host.other_bytes, len(rows) * costs.other_s)
    out.seconds = now
    out.compute_s = n_tokens * (n_layers * (costs.attn_s + costs.experts_s) + costs.other_s)
    out.compute_s += n_layers * (float(context_s.sum()) + len(blocks) * costs.host_s)
    return out


def _read_ahead(tiers: Tiers, layer: int, n_layers: int, n_experts: int, at: float) -> None:
    """layer_pass.py's read-ahead as a layer-wise pass reaches `layer` at `at`: where RAM holds all its records, those
    not there are read from the SSD in expert order, then what RAM holds besides of the next layer's (this layer's
    protected), behind the reads queued before; a wave that wants one later finds it in RAM at its read's end."""
    mine = [(layer, e) for e in range(n_experts)]
    if len(tiers.ram.fitting(mine)) < n_experts:
        return
    later = [(layer + 1, e) for e in range(n_experts)] if layer + 1 < n_layers else []
    ahead = tiers.ram.fitting(mine + later)[n_experts:]
    for keys, protected in ((mine, set()), (ahead, set(mine))):
        keep = protected | set(keys)
        for key in keys:
            if key in tiers.ram:
                continue
            if tiers.ram.allocate(key, keep) is None:
                return
            nbytes = tiers.nbytes(key)
            tiers.ssd_free = max(tiers.ssd_free, at) + nbytes / tiers.links.ssd
            tiers.in_ram[key] = tiers.ssd_free
            tiers.out.ssd_bytes += nbytes * tiers.counting


def _prefill_layer(
    tiers: Tiers,
    rows: np.ndarray,
    layer: int,
    now: float,
    costs: StepCosts,
    host: HostStream,
    gpu_slots: int,
    piece: int,
    context_s: float = 0.0,
) -> float:
    """One chunk's routing rows [n, L, K] through one MoE layer from `now` (its attention against earlier positions
    taking `context_s` beside its tokens' costs.attn_s; `piece`: the kernel's tokens a call, the chunk): its distinct
    experts in waves of the device slots, device hits first, then RAM's, then the SSD's -> when its compute is done."""
    out, (n, _, top_k) = tiers.out, rows.shape
    reads = -(-n // PREFILL_TILE_ROWS)
    streamed = layer in host.layers
    routed = tiers.stream(now, reads * host.attn_bytes * streamed, n * costs.attn_s + context_s) + costs.host_s
    uses = np.bincount(rows[:, layer].ravel())  # [E] the chunk's tokens per expert
    keys = [(layer, int(e)) for e in np.flatnonzero(uses)]
    out.uses += len(keys)

    def tier(key: Key) -> int:
        return 0 if key in tiers.gpu else 1 if key in tiers.ram else 2

    order = sorted(keys, key=tier)
    # when each wave's compute is done, the two before a wave first: a wave of half the slots or fewer copies into
    # those of the wave before the last (store/waves.py), a larger one into the last one's
    start, done = routed, [routed, routed]
    size = wave_size(len(order), gpu_slots)
    behind = 2 if 2 * size <= gpu_slots else 1
    # where a prompt's step takes several compacted waves (waves.py), the host plans and queues each: when it has
    # queued the last one
    planned, host_at = size < len(order) and compacts(n, piece), routed
    for at in range(0, len(order), size):
        wave = order[at : at + size]
        protected, ready, copies = set(wave), start, False
        for key in wave:
            if (there := tiers.on_gpu(key)) is not None:
                out.device_hits += 1
                ready = max(ready, there)
                continue
            arrival = tiers.bring(key, start, protected, demand=True, copy_after=done[-behind])
            if arrival is None:
                raise ValueError(f"{gpu_slots} device slots cannot hold a wave of {len(wave)} experts")
            ready, copies = max(ready, arrival), True
        out.stall_s += max(0.0, ready - max(start, done[-1]))
        # of the chunk's routed compute
        share = sum(int(uses[e]) for _, e in wave) / (n * top_k)
        if planned:
            # the host queues a wave once the store has its slots (freed by the compute of the wave before the last),
            # while the device computes the wave before: it waits for the device only there
            host_at = max(host_at, done[-behind] if copies else host_at) + costs.wave_s
        # the wave computes once its records are there, the wave before it is done and the host has queued it, then
        # frees its slots
        done.append(max(ready, done[-1], host_at) + share * n * costs.experts_s)
        # the store is asked for the next wave once this one is queued
        start = ready
    return tiers.stream(done[-1], reads * host.experts_bytes * streamed, 0.0)
