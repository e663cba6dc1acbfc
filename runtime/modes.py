"""Modes (--mode): named settings of the lossy levers that trade quality for fewer bytes per token, each chosen by
measurement (docs/BENCHMARKS.md: KL against exact NVFP4 on the trained small DeepSeek, and the whole model's projected
tok/s). A lever the run sets itself wins over its mode's. Prefetch (RAM-only) and CUDA graphs are on in every mode:
they cost no quality and were faster in every regime measured. Cache-aware routing is in none: on the trained model
it cost more KL than the threshold for each byte it saved.

  exact       the router's choice, every expert read (the default)
  latency     lossy at less KL than NVFP4's own rounding costs against the FP8 release
  balanced    the threshold where the whole model's projected decode gains half again
  throughput  the threshold where the whole model's projected decode reaches the design's 5 tok/s on the 16 GB
              machine, at a quality cost stated beside it

Each mode also names how many sequences `serve` and `run --batch` decode together by default (MODE_BATCH, for
--max-batch 0): one for `latency` (a step decodes only its own token's experts), the kernels' most for `throughput`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Levers:
    """What the expert store may trade: expert_threshold (StepLevers.skip_cold) and cache_aware (the score margin of
    runtime/store/cache_aware.py); 0 each is exact routing. `adaptive` (--expert-threshold auto): the threshold is a
    cap, and a step leaves out only the cold experts whose reads would outlast its copies of RAM hits over PCIe: it
    hides floor(hide_ratio x those copies) reads, hide_ratio the SSD's rate over the copies' (None: the store's own,
    measured as it runs)."""

    expert_threshold: float = 0.0
    cache_aware: float = 0.0
    adaptive: bool = False
    hide_ratio: float | None = None

    def describe(self) -> str:
        if self == EXACT:
            return "exact routing"
        threshold = f"auto (up to {self.expert_threshold:g})" if self.adaptive else f"{self.expert_threshold:g}"
        return f"expert threshold {threshold}, cache-aware margin {self.cache_aware:g}"


def parse_levers(text: str) -> Levers:
    """A mode's name, THRESHOLD:MARGIN, or auto[:HIDE_RATIO] (the adaptive threshold, at a machine's ratio of SSD to
    PCIe rates; the scripts that measure the levers take any); ValueError otherwise."""
    if text in MODES:
        return MODES[text]
    if text == "auto":
        return AUTO
    if text.startswith("auto:"):
        try:
            return dataclasses.replace(AUTO, hide_ratio=float(text.removeprefix("auto:")))
        except ValueError:
            raise ValueError(f"{text}: give auto:RATIO, the SSD's read rate over PCIe's copy rate") from None
    try:
        threshold, margin = (float(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"{text}: give a mode ({', '.join(MODES)}) or THRESHOLD:MARGIN") from None
    return Levers(threshold, margin)


EXACT = Levers()
MODES = {
    "exact": EXACT,
    "latency": Levers(expert_threshold=0.1),
    "balanced": Levers(expert_threshold=0.15),
    "throughput": Levers(expert_threshold=0.2),
}
# --expert-threshold auto: leaves out what a step cannot hide, at most what `throughput` leaves out
AUTO = Levers(expert_threshold=MODES["throughput"].expert_threshold, adaptive=True)
# sequences decoded together under --max-batch 0, as far as the device budget affords their caches and the tiers the
# experts a step is expected to need (planner.auto_batch, planner.union_batch)
MODE_BATCH = {"exact": 8, "latency": 1, "balanced": 8, "throughput": 16}
