"""/metrics' latency histograms in Prometheus' text format: time to first token and between tokens, in seconds, as a
generation's tokens reach the HTTP process (metrics.Metrics.token through Job.put)."""

from __future__ import annotations

import math

from dsfp4.runtime.generate.generation import Delta
from dsfp4.server.histogram import ITL_BOUNDS, TTFT_BOUNDS
from dsfp4.server.jobs import Job, Report
from dsfp4.server.metrics import Metrics

FAMILIES = {"dsfp4_time_to_first_token_seconds": TTFT_BOUNDS, "dsfp4_inter_token_latency_seconds": ITL_BOUNDS}


def histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(le, cumulative count) of each bucket line, the sum, the count: read back from the exposition text."""
    lines = text.splitlines()
    assert f"# TYPE {name} histogram" in lines and any(line.startswith(f"# HELP {name} ") for line in lines)
    buckets, total, count = [], None, None
    for line in lines:
        sample, value = line.rsplit(" ", 1)
        if sample.startswith(f'{name}_bucket{{le="'):
            buckets.append((float(sample.split('"')[1]), float(value)))
        elif sample == f"{name}_sum":
            total = float(value)
        elif sample == f"{name}_count":
            count = float(value)
    assert total is not None and count is not None, f"{name}: no _sum or _count"
    return buckets, total, count


def test_latency_histograms_follow_prometheus_conventions():
    m = Metrics()
    job = Job([1], {}, None, received=100.0, on_token=m.token)
    # the first token 0.3 s after the request; then 0.05 s (a bound: `le` counts it), 1.65 s and 20 minutes
    for at in (100.3, 100.35, 102.0, 1302.0):
        m.token(job, at)
    text = m.render(Report(True, 0, 0, 1, {}))
    # bounds print as their short decimals, not as 2.5 * 0.001 does
    assert 'dsfp4_inter_token_latency_seconds_bucket{le="0.0025"} 0\n' in text
    for name, bounds in FAMILIES.items():
        buckets, _, count = histogram(text, name)
        assert [le for le, _ in buckets] == [*bounds, math.inf], "one line per bound, ascending, then +Inf"
        counts = [n for _, n in buckets]
        assert counts == sorted(counts) and counts[-1] == count, "cumulative, the last the count"
    buckets, total, count = histogram(text, "dsfp4_time_to_first_token_seconds")
    assert count == 1 and math.isclose(total, 0.3) and dict(buckets)[0.25] == 0 and dict(buckets)[0.5] == 1
    buckets, total, count = histogram(text, "dsfp4_inter_token_latency_seconds")
    assert count == 3 and math.isclose(total, 0.05 + 1.65 + 1200)
    at = dict(buckets)
    assert at[0.025] == 0 and at[0.05] == 1 and at[1.0] == 1 and at[2.5] == 2 and at[100.0] == 2 and at[math.inf] == 3


def test_the_bounds_cover_this_tools_range():
    # tokens at 0.1-10 s each where experts stream from the SSD, milliseconds resident; first tokens up to minutes
    assert ITL_BOUNDS[0] <= 0.001 and ITL_BOUNDS[-1] >= 10 and TTFT_BOUNDS[-1] >= 600
    for bounds in FAMILIES.values():
        assert all(b / a <= 2.5 for a, b in zip(bounds, bounds[1:], strict=False)), "no bucket spans more than 2.5x"


def test_only_a_token_is_timed_and_each_job_on_its_own():
    m = Metrics()
    a, b = (Job([1], {}, None, on_token=m.token) for _ in range(2))
    for job in (a, b):
        job.put(Delta(5, "x"))
    a.put(Delta(6, "y"))
    a.put(None)  # its end: no token
    text = m.render(Report(True, 0, 0, 1, {}))
    assert histogram(text, "dsfp4_time_to_first_token_seconds")[2] == 2
    assert histogram(text, "dsfp4_inter_token_latency_seconds")[2] == 1
    assert a.out.qsize() == 3 and b.out.qsize() == 1
