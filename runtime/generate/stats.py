"""What one generation cost: token counts, time to first token, prefill and decode speed, and the
expert store's counters over the generation (tiers hit, bytes moved, prefetch quality, stalls, peaks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from dsfp4.units import format_bytes


def ratio(a: float, b: float) -> float:
    """a / b, 0 when b is 0 (nothing measured yet)."""
    return a / b if b else 0.0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    # prompt tokens whose latent KV was already cached (earlier chat turns, the prompt cache)
    cached_tokens: int = 0
    # ... of them, those restored from the prompt cache (--prompt-cache)
    restored_tokens: int = 0
    # entries the prompt cache skipped (damaged, unreadable) or could not write
    prompt_cache_note: str = ""
    generated_tokens: int = 0
    ttft_s: float = 0.0
    # inter-token time: from one generated token to the next as the caller gets them, median and 99th percentile
    itl_p50_s: float = 0.0
    itl_p99_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # expert store counters over this generation
    store: dict[str, float] = field(default_factory=dict)
    # torch's max reserved device bytes since the engine was created
    peak_gpu: int = 0
    # the process's peak RSS so far (VmHWM), which cannot be reset per generation
    peak_rss: int = 0
    # MTP speculative decoding (--mtp): drafts checked and kept, and the two kinds of decode step, timed
    drafted: int = 0
    accepted: int = 0
    verify_s: float = 0.0
    plain_steps: int = 0
    plain_s: float = 0.0
    # why drafting stopped, when it did
    mtp_note: str = ""
    # "CUDA graph", or "eager" and why (runtime/generate/decode_graph.py)
    decode_mode: str = ""
    # the routing trace the MoE layers took their experts from, and its prefetcher (--routing)
    routing: str = ""
    # the CPU lane's split and what decided it (--cpu-experts), when it runs
    cpu_lane: str = ""
    # the engine's warm start from hot.json, before its first generation (the same in each generation's stats)
    warm_records: int = 0
    warm_s: float = 0.0
    # bytes of backbone in host memory a decode step reads over PCIe (the plan's)
    host_backbone_step: int = 0
    # bytes of KV cache in host memory the generation's last decode step read over PCIe (its rows up to there)
    host_cache_step: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return ratio(self.prompt_tokens - self.cached_tokens, self.prefill_s)

    @property
    def decode_tok_s(self) -> float:
        # the first token comes out of the prefill
        n = self.generated_tokens - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    def derived(self) -> dict[str, float]:
        s = self.store
        uses = s.get("expert_uses", 0)
        tokens = max(self.generated_tokens + self.prompt_tokens - self.cached_tokens, 1)
        return {
            "expert_uses": uses,
            "gpu_hit_rate": ratio(s.get("gpu_hits", 0), uses),
            "ram_hit_rate": ratio(s.get("ram_hits", 0), uses),
            "ssd_bytes_per_token": ratio(s.get("ssd_bytes", 0), tokens),
            "h2d_bytes_per_token": ratio(s.get("h2d_bytes", 0), tokens),
            "prefetch_precision": ratio(s.get("predicted_used", 0), s.get("predicted", 0)),
            "prefetch_recall": ratio(s.get("predicted_used", 0), s.get("actual", 0)),
            # of the experts chosen
            "skipped_share": ratio(s.get("skipped", 0), uses + s.get("skipped", 0)),
            "skipped_bytes_per_token": ratio(s.get("skipped_bytes", 0), tokens),
            # of the experts chosen
            "swapped_share": ratio(s.get("swapped", 0), uses + s.get("skipped", 0)),
            # computed on the host from RAM (the CPU lane)
            "host_share": ratio(s.get("host_computed", 0), uses),
            "ssd_read_gb_s": ratio(s.get("ssd_bytes", 0), s.get("ssd_read_s", 0)) / 1e9,
            "acceptance_rate": ratio(self.accepted, self.drafted),
            "tokens_per_verify": ratio(self.drafted + self.accepted, self.drafted),
            # decode speed while drafting
            "mtp_tok_s": ratio(self.drafted + self.accepted, self.verify_s),
            # ... and while not (probe or fallback)
            "plain_tok_s": ratio(self.plain_steps, self.plain_s),
        }

    @classmethod
    def from_dict(cls, d: dict) -> GenerationStats:
        """Back from to_dict() (the server's `stats` object): the derived figures are recomputed."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
            **self.derived(),
        }

    def line(self) -> str:
        restored = f", {self.restored_tokens} from the prompt cache" if self.restored_tokens else ""
        cached = f" ({self.cached_tokens} cached{restored})" if self.cached_tokens else ""
        d = self.derived()
        return (
            f"prompt {self.prompt_tokens} tokens{cached}, TTFT {self.ttft_s:.2f} s, prefill "
            f"{self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.1f} tok/s "
            f"({self.generated_tokens} tokens), experts: {d['gpu_hit_rate']:.0%} on device, "
            f"{d['ram_hit_rate']:.0%} RAM, SSD {format_bytes(self.store.get('ssd_bytes', 0))}"
            + (f", {d['skipped_share']:.1%} left out by the threshold" if self.store.get("skipped") else "")
            + (f", {d['swapped_share']:.1%} swapped for warm experts" if self.store.get("swapped") else "")
            + (f", {d['host_share']:.1%} computed on the CPU" if self.store.get("host_computed") else "")
            + (f", MTP {d['acceptance_rate']:.0%} of {self.drafted} drafts kept" if self.drafted else "")
        )

    def table(self) -> str:
        """The full picture, for --stats and the chat's /stats."""
        s, d = self.store, self.derived()
        rows = [
            (
                "tokens",
                f"{self.prompt_tokens} prompt ({self.cached_tokens} cached, {self.restored_tokens} of them from the "
                f"prompt cache), {self.generated_tokens} generated",
            ),
            *([("prompt cache", self.prompt_cache_note)] if self.prompt_cache_note else []),
            (
                "speed",
                f"TTFT {self.ttft_s:.3f} s, prefill {self.prefill_tok_s:.1f} tok/s, "
                f"decode {self.decode_tok_s:.2f} tok/s, between tokens {self.itl_p50_s * 1e3:.1f} ms median, "
                f"{self.itl_p99_s * 1e3:.1f} ms p99" + (f" ({self.decode_mode})" if self.decode_mode else ""),
            ),
            (
                "expert uses",
                f"{d['expert_uses']:.0f}: device {d['gpu_hit_rate']:.1%}, RAM {d['ram_hit_rate']:.1%}, "
                f"SSD {max(1 - d['gpu_hit_rate'] - d['ram_hit_rate'], 0):.1%}",
            ),
            (
                "SSD reads",
                f"{s.get('ssd_reads', 0):.0f} records, {format_bytes(s.get('ssd_bytes', 0))} "
                f"({format_bytes(d['ssd_bytes_per_token'])}/token, {d['ssd_read_gb_s']:.2f} GB/s per reader)",
            ),
            (
                "host->device",
                f"{format_bytes(s.get('h2d_bytes', 0))} of experts ({format_bytes(d['h2d_bytes_per_token'])}/token)"
                + (
                    f"; backbone in RAM read in place, {format_bytes(self.host_backbone_step)}/step"
                    * bool(self.host_backbone_step)
                )
                + (
                    f"; KV cache in RAM read in place, {format_bytes(self.host_cache_step)} at the last step"
                    * bool(self.host_cache_step)
                ),
            ),
            (
                "prefetch",
                f"{s.get('prefetch_loads', 0):.0f} loads, precision {d['prefetch_precision']:.1%}, "
                f"recall {d['prefetch_recall']:.1%}",
            ),
            ("waiting", f"{s.get('stall_s', 0):.3f} s for experts of {self.prefill_s + self.decode_s:.3f} s"),
            *(
                [
                    (
                        "threshold",
                        f"{s['skipped']:.0f} cold experts left out ({d['skipped_share']:.1%} of those chosen), "
                        f"{format_bytes(s.get('skipped_bytes', 0))} not read",
                    )
                ]
                if s.get("skipped")
                else []
            ),
            *(
                [("cache-aware", f"{s['swapped']:.0f} cold choices swapped for warm ones ({d['swapped_share']:.1%})")]
                if s.get("swapped")
                else []
            ),
            *(
                [
                    (
                        "CPU lane",
                        f"{self.cpu_lane}: {s.get('host_computed', 0):.0f} RAM hits computed on the CPU "
                        f"({d['host_share']:.1%} of uses) in {s.get('host_s', 0):.3f} s, "
                        f"{s.get('host_wait_s', 0):.3f} s of it waited for",
                    )
                ]
                if self.cpu_lane
                else []
            ),
            *([("routing", self.routing)] if self.routing else []),
            *(
                [("warm start", f"{self.warm_records} records in {self.warm_s:.2f} s, at load")]
                if self.warm_records
                else []
            ),
            ("peak memory", f"device {format_bytes(self.peak_gpu)}, process RSS {format_bytes(self.peak_rss)}"),
        ]
        if self.drafted or self.plain_steps:
            mtp = (
                f"{self.drafted} drafts, {self.accepted} kept ({d['acceptance_rate']:.1%}), "
                f"{d['tokens_per_verify']:.2f} tokens per verify step; decode {d['mtp_tok_s']:.2f} tok/s drafting, "
                f"{d['plain_tok_s']:.2f} tok/s plain ({self.plain_steps} steps)"
            )
            rows.append(("MTP", mtp + (f"; {self.mtp_note}" if self.mtp_note else "")))
        w = max(len(a) for a, _ in rows)
        return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)
