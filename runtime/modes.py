"""Modes (--mode): named settings of the lossy levers that trade quality for fewer bytes per token, each chosen by
measurement (docs/BENCHMARKS.md: KL against exact NVFP4 on the trained small DeepSeek, and the whole model's projected
tok/s). A lever the run sets itself wins over its mode's. Prefetch (RAM-only) and CUDA graphs are on in every mode:
they cost no quality and were faster in every regime measured. Cache-aware routing is in none: on the trained model
it cost about twice the KL of the threshold for each byte it saved.

  exact       the router's choice, every expert read (the default)
  latency     lossy at less KL than NVFP4's own rounding costs against the FP8 release
  balanced    the threshold where the whole model's projected decode gains half again
  throughput  the threshold where the whole model's projected decode reaches the design's 5 tok/s on the 16 GB
              machine, at a quality cost stated beside it

Each mode also names how many sequences `serve` and `run --batch` decode together by default (MODE_BATCH, for
--max-batch 0): one for `latency` (a step decodes only its own token's experts), the kernels' most for `throughput`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Levers:
    """What the expert store may trade: expert_threshold (ExpertStore.skip_cold) and cache_aware (the score margin of
    runtime/models/cache_aware.py); 0 each is exact routing."""

    expert_threshold: float = 0.0
    cache_aware: float = 0.0

    def describe(self) -> str:
        if self == EXACT:
            return "exact routing"
        return f"expert threshold {self.expert_threshold:g}, cache-aware margin {self.cache_aware:g}"


def parse_levers(text: str) -> Levers:
    """A mode's name, or THRESHOLD:MARGIN (the scripts that measure the levers take either); ValueError otherwise."""
    if text in MODES:
        return MODES[text]
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
# sequences decoded together under --max-batch 0, as far as the device budget affords their caches and the tiers the
# experts a step is expected to need (planner.auto_batch, planner.union_batch)
MODE_BATCH = {"exact": 8, "latency": 1, "balanced": 8, "throughput": 16}
