"""What one generation cost: token counts, time to first token, prefill and decode speed, expert reads."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsfp4.sizes import format_bytes


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose latent KV was already cached (earlier chat turns)
    generated_tokens: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    expert_loads: int = 0
    expert_bytes: int = 0

    @property
    def prefill_tok_s(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        n = self.generated_tokens - 1  # the first token comes out of the prefill
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s}

    def line(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (
            f"prompt {self.prompt_tokens} tokens{cached}, TTFT {self.ttft_s:.2f} s, prefill "
            f"{self.prefill_tok_s:.1f} tok/s, decode {self.decode_tok_s:.1f} tok/s "
            f"({self.generated_tokens} tokens), experts read {self.expert_loads} "
            f"({format_bytes(self.expert_bytes)})"
        )
