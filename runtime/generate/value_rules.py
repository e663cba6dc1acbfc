"""What a sampling or lever value must be whichever door it comes in by (a flag, a batch line, an API request, a
Python call): a number is finite, a seed fits the 63 bits every generator takes. Torch-free: the HTTP process, the
command line's flag types and runtime/options.py share these."""

from __future__ import annotations

import math

# seeds are 0 .. SEED_LIMIT - 1: torch's generators take 64 bits, and the API's seeds count up per choice
SEED_LIMIT = 1 << 63


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that is neither NaN nor infinite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def seed_problem(seed: int | None) -> str | None:
    """None when `seed` is None or a seed generators take, else what to give instead."""
    if seed is None or 0 <= seed < SEED_LIMIT:
        return None
    return f"give an integer from 0 to {SEED_LIMIT - 1}"
