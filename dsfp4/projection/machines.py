"""The user machines a projection plans for: each one's budgets, GPU memory bandwidth and compute peak, SSD and
pinned PCIe links, and what `dsfp4 run` holds there as it plans (not what the projecting process holds)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dsfp4.projection.simulate import Links
from dsfp4.runtime.plan.budget import PRESETS, Budgets, GiB

# RSS of a `dsfp4 run` as it plans, on the H200 machine (docs/BENCHMARKS.md)
USER_PROCESS = int(0.56 * GiB)


# sm_80/86 (no e4m3 in hardware): the FP8 backbone converted by bits in the kernels, resident decode 91% of the
# native path's on the H200 with the path forced (docs/BENCHMARKS.md, 2026-12-02)
BY_BITS_DECODE = 0.91
# the FP8 backbone's prefill GEMMs as a share of the card's dense BF16 peak: W8A8 on FP8 tensor cores (sm_89 on) and
# by bits (sm_80/86: W widened to bf16 in pieces for cuBLAS, kernels/fp8/widened_gemm.py), V3's q_a, q_b, o and dense
# w13 at 4,096 tokens on the H200 weighted by a token's FLOPs in each (docs/BENCHMARKS.md, 2026-12-02: native in the
# FP8 backbone by bits, widened in the widened GEMM)
NATIVE_FP8_PREFILL, BY_BITS_PREFILL = 0.565, 0.723


@dataclass(frozen=True)
class Machine:
    about: str
    budgets: Budgets
    # the GPU's memory bandwidth, bytes/s
    hbm: float
    links: Links
    # the GPU's dense BF16 tensor peak (FP32 accumulate), FLOP/s: NVIDIA's specifications
    flops: float
    # cards in the box (budgets.cards each one's): the whole model planned split across them (runtime/plan/
    # device_split.py); hbm, flops and links are each card's, and a layer's copies go over its own card's link
    cards: int = 1
    # the card's decode compute speed on its kernel path, as a share of the measured native path's (the projection's
    # efficiency is the native path's)
    path_speed: float = 1.0
    # the FP8 backbone's prefill GEMMs on its kernel path, as a share of `flops`
    fp8_prefill: float = NATIVE_FP8_PREFILL

    def decode_efficiency(self, eff: float) -> float:
        """The decode's share of this card's memory bandwidth, `eff` the native path's."""
        return eff * self.path_speed


# one card a box
ONE_CARD = {
    "16g": Machine(
        "the design's seed machine: 16 GB GPU (896 GB/s, 88 BF16 TFLOP/s: an RTX 5070 Ti, sm_120), 96 GB RAM, "
        "14 GB/s PCIe 5 SSD, 50 GB/s pinned PCIe",
        Budgets(PRESETS["16g"].gpu, PRESETS["16g"].cpu, "preset 16g"),
        896e9,
        Links(14e9, 50e9),
        87.9e12,
    ),
    "24g": Machine(
        "24 GB GPU (1,008 GB/s, 165 BF16 TFLOP/s: an RTX 4090, sm_89), 96 GB RAM, 14 GB/s SSD, 50 GB/s pinned PCIe "
        "(the 16g machine's links)",
        Budgets(PRESETS["24g"].gpu, PRESETS["24g"].cpu, "preset 24g"),
        1008e9,
        Links(14e9, 50e9),
        165.2e12,
    ),
    # the most common card for a local DeepSeek; no e4m3 in hardware: its FP8 backbone is converted by bits in the
    # kernels (BY_BITS_DECODE, BY_BITS_PREFILL)
    "3090": Machine(
        "RTX 3090 24 GB (936 GB/s, 71 BF16 TFLOP/s with FP32 accumulate, sm_86), 96 GB RAM, 7 GB/s PCIe 4 SSD, "
        "25 GB/s pinned PCIe 4",
        Budgets(PRESETS["24g"].gpu, PRESETS["24g"].cpu, "preset 24g"),
        936e9,
        Links(7e9, 25e9),
        71e12,
        path_speed=BY_BITS_DECODE,
        fp8_prefill=BY_BITS_PREFILL,
    ),
    "home-seek": Machine(
        "home-seek's: RTX 4090 24 GB (1,008 GB/s), ~90 GB RAM, 1.5 GB/s disk, PCIe 4 (25 GB/s pinned)",
        Budgets(23 * GiB, 76 * GiB, "home-seek's machine"),
        1008e9,
        Links(1.5e9, 25e9),
        165.2e12,
    ),
}


def two_cards(one: Machine, about: str) -> Machine:
    """Machine `one` with a second card of its kind: each card's budget the 2x24g preset's, the RAM, SSD and speeds
    of `one`, each card on a PCIe link of its own (x16 each: on a board that splits x8/x8 each is half as fast)."""
    per_card = PRESETS["2x24g"].gpu
    budgets = Budgets(2 * per_card, PRESETS["2x24g"].cpu, "preset 2x24g", (per_card,) * 2)
    return dataclasses.replace(one, about=about, budgets=budgets, cards=2)


MACHINES = {
    **ONE_CARD,
    "2x3090": two_cards(ONE_CARD["3090"], "two RTX 3090 24 GB: the 3090 machine's RAM, SSD and links, a link each"),
    "2x4090": two_cards(ONE_CARD["24g"], "two RTX 4090 24 GB: the 24g machine's RAM, SSD and links, a link each"),
}


def on_presets(presets: list[str]) -> list[str]:
    """The machine classes planned under those budget presets, in their order: each preset's own class, then the
    cards that share its budgets (the 3090's are the 24g's)."""
    sources = {f"preset {p}" for p in presets}
    return [*presets, *(k for k, m in MACHINES.items() if k not in presets and m.budgets.source in sources)]
