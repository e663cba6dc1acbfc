"""How a sequence samples: the temperature, min-p, top-k and top-p filters, the seed, the penalties and the
log-probabilities it reports. A plain dataclass, free of torch: runtime/options.py builds it and the command line
reads that module; sampling.py draws by it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.6
    top_p: float = 0.95
    # 0: off
    top_k: int = 0
    seed: int | None = None
    # OpenAI's: subtracted from a token's logit once it was generated (presence), per time generated (frequency)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # CTRL's, over prompt and generated tokens: a positive logit divided by it, a negative one multiplied (1: off)
    repetition_penalty: float = 1.0
    # after temperature, tokens less probable than min_p times the most probable one are left out (0: off)
    min_p: float = 0.0
    # report each token's log-probability and this many alternatives (None: none reported)
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits (they then need the tokens so far: logits_rules.py)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0
