"""The server's counters, and `GET /metrics` in Prometheus' text format (version 0.0.4)."""

from __future__ import annotations

import threading
from collections import Counter

from dsfp4.runtime.generate.generation import Generation
from dsfp4.runtime.generate.stats import GenerationStats, ratio
from dsfp4.server.histogram import ITL_BOUNDS, TTFT_BOUNDS, Histogram
from dsfp4.server.jobs import Job, Report

TIERS = ("gpu_hits", "ram_hits")


class Metrics:
    """Updated from the request handlers and the engine's worker thread, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (endpoint, status) -> requests answered
        self.requests: Counter[tuple[str, int]] = Counter()
        # finish reason ("stop", "length", "cancelled", "error")
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = self.decode_tokens = 0
        self.prefill_s = self.decode_s = 0.0
        # as a generation's tokens reach this process: from its request's arrival to the first, between the others
        self.ttft = Histogram(TTFT_BOUNDS)
        self.itl = Histogram(ITL_BOUNDS)

    def answered(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] += 1

    def finish(self, reason: str, stats: GenerationStats | None = None) -> None:
        with self._lock:
            self.finished[reason] += 1
            if stats is None:
                return
            self.prompt_tokens += stats.prompt_tokens
            self.cached_tokens += stats.cached_tokens
            self.generated_tokens += stats.generated_tokens
            # the first comes out of the prefill
            self.decode_tokens += max(stats.generated_tokens - 1, 0)
            self.prefill_s += stats.prefill_s
            self.decode_s += stats.decode_s

    def token(self, job: Job, now: float) -> None:
        """A token of `job` reached the channel at perf_counter `now`."""
        with self._lock:
            if job.last_token is None:
                self.ttft.observe(now - job.received)
            else:
                self.itl.observe(now - job.last_token)
        job.last_token = now

    def done(self, job: Job, result: Generation | None) -> None:
        """A job ended: finished (result), cancelled by its client or the shutdown, or failed."""
        if result is not None:
            self.finish(result.finish_reason, result.stats)
        else:
            self.finish("cancelled" if job.cancelled.is_set() else "error")

    def render(self, engine: Report) -> str:
        """The text a Prometheus scraper reads, with the engine's state: its running generations of its slots, the
        expert store's counters since the engine opened (a batch's generations share its steps, so theirs would not
        add up), the prefill under way; then the latency histograms."""
        with self._lock:
            rows = [
                (name, kind, text, [(name, *s) for s in samples]) for name, kind, text, samples in self._rows(engine)
            ]
            for name, hist, text in (
                (
                    "dsfp4_time_to_first_token_seconds",
                    self.ttft,
                    "From a request's arrival (its body read) to its generation's first token, queue and prefill "
                    "included; a generation per choice.",
                ),
                ("dsfp4_inter_token_latency_seconds", self.itl, "Between two tokens of a generation, as they stream."),
            ):
                rows.append((name, "histogram", text, hist.samples(name)))
        lines = []
        for family, kind, help_text, samples in rows:
            lines += [f"# HELP {family} {help_text}", f"# TYPE {family} {kind}"]
            for name, labels, value in samples:
                label = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"{name}{{{label}}} {_value(value)}" if label else f"{name} {_value(value)}")
        return "\n".join(lines) + "\n"

    def _rows(self, engine: Report) -> list[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        """The counters' and gauges' (name, type, help, [(labels, value)]), under the lock."""
        store, running = engine.counters, engine.running
        uses = store.get("expert_uses", 0)
        return [
            (
                "dsfp4_requests_total",
                "counter",
                "Requests answered, by endpoint and HTTP status.",
                [({"endpoint": e, "status": str(s)}, n) for (e, s), n in sorted(self.requests.items())],
            ),
            (
                "dsfp4_generations_total",
                "counter",
                "Generations ended, by finish reason.",
                [({"reason": r}, n) for r, n in sorted(self.finished.items())],
            ),
            (
                "dsfp4_prompt_tokens_total",
                "counter",
                "Prompt tokens of finished generations.",
                [({}, self.prompt_tokens)],
            ),
            (
                "dsfp4_prompt_cached_tokens_total",
                "counter",
                "Prompt tokens whose KV was reused.",
                [({}, self.cached_tokens)],
            ),
            (
                "dsfp4_generated_tokens_total",
                "counter",
                "Tokens generated by finished generations.",
                [({}, self.generated_tokens)],
            ),
            (
                "dsfp4_prefill_tokens_per_second",
                "gauge",
                "Prefill speed over all finished generations.",
                [({}, ratio(self.prompt_tokens - self.cached_tokens, self.prefill_s))],
            ),
            (
                "dsfp4_decode_tokens_per_second",
                "gauge",
                "Decode speed of a generation, over all finished ones (a batch's add up to more).",
                [({}, ratio(self.decode_tokens, self.decode_s))],
            ),
            (
                "dsfp4_expert_hit_rate",
                "gauge",
                "Share of expert uses served by each tier.",
                [({"tier": t.removesuffix("_hits")}, ratio(store.get(t, 0), uses)) for t in TIERS]
                + [({"tier": "ssd"}, ratio(max(uses - sum(store.get(t, 0) for t in TIERS), 0), uses))],
            ),
            (
                "dsfp4_ssd_read_bytes_total",
                "counter",
                "Expert record bytes read from the SSD.",
                [({}, store.get("ssd_bytes", 0))],
            ),
            ("dsfp4_queue_depth", "gauge", "Requests waiting for the engine.", [({}, engine.waiting)]),
            ("dsfp4_busy", "gauge", "1 while a generation runs.", [({}, int(running > 0))]),
            ("dsfp4_running", "gauge", "Generations running (decoding together when batched).", [({}, running)]),
            (
                "dsfp4_batch_occupancy",
                "gauge",
                "Running generations over the slots (--max-batch).",
                [({}, running / engine.slots)],
            ),
            (
                "dsfp4_prefill_tokens_done",
                "gauge",
                "Prompt tokens the prefill under way has fed (0 when none runs).",
                [({}, engine.prefill_done)],
            ),
            (
                "dsfp4_prefill_tokens",
                "gauge",
                "Prompt tokens the prefill under way feeds, done or not (0 when none runs).",
                [({}, engine.prefill_total)],
            ),
        ]


def _value(v: float) -> str:
    """Exact for counts (Prometheus parses a float; '%g' would round 123456789 to 1.23457e+08)."""
    return str(int(v)) if float(v).is_integer() else repr(float(v))
