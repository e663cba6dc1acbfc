"""A Prometheus histogram of seconds: counts by upper bound, their sum and their count, as `/metrics` shows them
(`NAME_bucket{le="B"}` counts the observations of at most B seconds, cumulative, up to `le="+Inf"`; `NAME_sum`,
`NAME_count`)."""

from __future__ import annotations

from bisect import bisect_left

# the steps of each decade: a bucket's bound is at most 2.5 times the one below it
DECADE_STEPS = (1, 2.5, 5)


def decade_bounds(low_exp: int, high_exp: int) -> tuple[float, ...]:
    """1, 2.5 and 5 times each power of ten from 10**low_exp, up to 10**high_exp."""
    # from the decimal text: 2.5 * 0.001 would print as 0.0025000000000000005
    steps = [float(f"{m}e{e}") for e in range(low_exp, high_exp) for m in DECADE_STEPS]
    return (*steps, float(f"1e{high_exp}"))


# time to first token: ~10 ms for a short prompt with every expert on the device, seconds to tens of seconds on a
# machine that streams experts from the SSD (a 2,048-token prompt of the whole V3 at 16 GB: ~26 s), minutes for a
# prompt near the context's end
TTFT_BOUNDS = decade_bounds(-2, 3)
# between two tokens: ~1 ms resident, 0.1 to 10 s where the experts stream from the SSD, and a stream's wait behind a
# prefill (--prefill-yield-ms) above that
ITL_BOUNDS = decade_bounds(-3, 2)


class Histogram:
    """Observations of seconds into buckets of the given upper bounds (and one above the last: +Inf)."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        # per bucket, not cumulative: an observation lands in the first bucket whose bound is not below it
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.total += seconds

    def samples(self, name: str) -> list[tuple[str, dict[str, str], float]]:
        """(sample name, labels, value) of each line: the cumulative buckets, the sum, the count."""
        out, seen = [], 0
        for bound, n in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            seen += n
            out.append((f"{name}_bucket", {"le": bound}, seen))
        return [*out, (f"{name}_sum", {}, self.total), (f"{name}_count", {}, seen)]
