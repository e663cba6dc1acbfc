"""A peer that streams its routed experts through the page cache, projected for the whole model beside dsfp4's store:
llama.cpp and ik_llama.cpp with the model mmapped and the experts computed on the CPU (`-ot exps=CPU`), the rest of
the model on the GPU. It runs under the same trace, machine and RAM as the store's projection (whole_model.py
MachineRun), and each part is a stated bound or a figure measured side by side:
- the page cache holds as many records as the store's RAM slots, least recently used out first. It is warm from the
  trace's first half as the store's tiers are, hottest last in, and it has no prefetch;
- each miss reads `amplification` times its record's bytes (read-ahead and the neighbours in the expert tensors) at
  the machine's SSD rate. ik_llama.cpp read 2.8x the bytes of the experts its tokens used (docs/BENCHMARKS.md
  2026-12-03); as a share of what it missed, under a cache that also hit, it read more, so that figure per miss is
  generous to it;
- the CPU multiplies every routed expert a token uses at `cpu_rate` bytes a second (at most the RAM's bandwidth);
- the GPU's part (attention, router, shared experts, dense layers, head) costs what dsfp4's decode step costs there,
  the host's round trips and the hand-offs between CPU and GPU left out;
- its time a token is bounded two ways: nothing overlapping (an mmap fault stalls the thread that computes), and
  the faults wholly behind the CPU's work (read-ahead and the other threads: the peer's best).
The tokens scored are those dsfp4's decode scores (MachineRun.warmup on).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from dsfp4.projection.whole_model import MachineRun, n_moe_layers, step_bytes

# what ik_llama.cpp read from the disk per decoded token over what its tokens' experts hold, at V3's 16g share on the
# H200's virtual disk (1.04 against 0.37 GB, docs/BENCHMARKS.md 2026-12-03)
IK_AMPLIFICATION = 1.04 / 0.37

Key = tuple[int, int]


def page_cache_misses(run: np.ndarray, warm: list[Key], capacity: int) -> np.ndarray:
    """run [N, L, K] expert ids through an LRU of `capacity` (layer, expert) records, filled first from `warm`
    (hottest first, so the hottest is the last one out) -> [N] records each token misses."""
    cache: OrderedDict[Key, None] = OrderedDict((k, None) for k in reversed(warm[:capacity]))
    misses = np.zeros(len(run), dtype=np.int64)
    for t, token in enumerate(run):
        for layer, ids in enumerate(token):
            for e in dict.fromkeys(ids.tolist()):
                key = (layer, e)
                if key in cache:
                    cache.move_to_end(key)
                    continue
                misses[t] += 1
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return misses


@dataclass(frozen=True)
class PeerDecode:
    """A token of the peer's decode, averaged: the seconds of its SSD faults, its CPU's experts and its GPU's part,
    and the bytes it reads from the SSD."""

    ssd_s: float
    cpu_s: float
    gpu_s: float
    ssd_bytes: float

    @property
    def seconds(self) -> float:
        """Nothing overlapping."""
        return self.ssd_s + self.cpu_s + self.gpu_s

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds

    @property
    def overlapped_tok_s(self) -> float:
        """The faults wholly behind the CPU's work (or it behind them): the peer's best."""
        return 1.0 / (max(self.ssd_s, self.cpu_s) + self.gpu_s)


def peer_decode(r: MachineRun, amplification: float, cpu_rate: float) -> PeerDecode:
    """The peer on `r`'s machine and trace (the module docstring), its page cache the plan's RAM slots."""
    m, rec = r.m, r.m.record.nbytes
    misses = page_cache_misses(r.run, r.warm, r.plan.ram_slots)[r.warmup :]
    ssd_bytes = float(misses.mean()) * rec * amplification
    scored = r.run[r.warmup :]
    uses = float(np.mean([len(set(layer.tolist())) for token in scored for layer in token])) * r.run.shape[1]
    attn, experts, other = step_bytes(m)
    routed = m.args.n_activated_experts * rec
    layers = n_moe_layers(m)
    # dsfp4's step on this GPU, its routed experts' share taken out
    gpu_s = r.costs.attn_s * layers + r.costs.other_s + r.costs.experts_s * layers * (experts - routed) / experts
    return PeerDecode(ssd_bytes / r.machine.links.ssd, uses * rec / cpu_rate, gpu_s, ssd_bytes)
