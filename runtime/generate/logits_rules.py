"""What one sequence does to its logits before a token is chosen, and what it notes of each token taken: presence,
frequency and repetition penalties (from the tokens so far), a grammar's mask, and log-probabilities.

A sequence whose sampling has no penalty, no log-probabilities and no grammar has no rules (`rules_for` gives None):
it keeps the fast paths as they are (choosing on the device one step ahead, a batch's argmax). One with rules reads
each token on the host: `pick` processes the logits, chooses and accepts; speculative decoding processes a draft's
and the check's logits alike, and accepts only the tokens it keeps, so the grammar advances on those alone.

Penalties as OpenAI and vLLM define them: repetition (CTRL's) first, over the prompt's and the generated tokens, a
positive logit divided by it and a negative one multiplied; then frequency (times the token's count so far) and
presence (once, if it was generated) subtracted, over the generated tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dsfp4.errors import ConfigError
from dsfp4.runtime.generate.answer.grammar_matcher import GrammarCompiler, GrammarMatcher
from dsfp4.runtime.generate.generation import TokenLogprob
from dsfp4.runtime.generate.logprobs import token_logprob
from dsfp4.runtime.generate.sampling import sample
from dsfp4.runtime.generate.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dsfp4.runtime.options import SamplingOptions


def penalize(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [V] -> penalized fp32 [V] (a new tensor): counts [V] are the generated tokens' counts, seen [V] bool the
    tokens of the prompt or generated (repetition_penalty's)."""
    x = logits.float()
    if p.repetition_penalty != 1.0:
        r = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if p.frequency_penalty:
        x = x - p.frequency_penalty * counts
    if p.presence_penalty:
        x = x - p.presence_penalty * (counts > 0).float()
    return x if x is not logits else x.clone()


class TokenRules:
    """One sequence's rules: its sampling, the prompt's tokens (repetition_penalty counts them) and its grammar
    (None: unconstrained). `logprobs` lists an entry per token accepted when the sampling asks for them (else None).
    The counts live on the logits' device, made at the first `process`."""

    def __init__(self, sampling: SamplingParams, prompt_ids: Sequence[int], grammar: GrammarMatcher | None = None):
        self.sampling, self.prompt_ids, self.grammar = sampling, list(prompt_ids), grammar
        self.logprobs: list[TokenLogprob] | None = [] if sampling.logprobs is not None else None
        # generated tokens' counts [V] fp32 and the tokens seen, prompt's too [V] bool
        self.counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> fp32 [V]: penalties from the tokens so far, then the grammar's mask (-inf where it refuses).
        Reads the state, changes nothing: a draft's logits and the check's go through it alike."""
        x = logits.float()
        if self.sampling.penalized:
            if self.counts is None:
                self.counts = torch.zeros(x.shape[-1], device=x.device)
                self.seen = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
                self.seen[torch.tensor(self.prompt_ids, dtype=torch.long, device=x.device)] = True
            x = penalize(x, self.counts, self.seen, self.sampling)
        if self.grammar is not None:
            x = self.grammar.mask(x)
        return x

    def accept(self, token: int, processed: torch.Tensor) -> None:
        """The sequence took `token`, chosen from `processed` (process's): its log-probability noted, counts and
        grammar advanced."""
        if self.logprobs is not None:
            self.logprobs.append(token_logprob(processed, token, self.sampling.logprobs))
        if self.counts is not None:
            self.counts[token] += 1
            self.seen[token] = True
        if self.grammar is not None:
            self.grammar.accept(token)

    def pick(self, logits: torch.Tensor, gen: torch.Generator | None) -> int:
        """The next token from raw logits [V]: processed, chosen by the sampling (greedy or drawn), accepted."""
        processed = self.process(logits)
        token = sample(processed, self.sampling, gen)
        self.accept(token, processed)
        return token


def rules_for(
    options: SamplingOptions, prompt_ids: Sequence[int], grammars: GrammarCompiler | None
) -> TokenRules | None:
    """A sequence's rules from its options (its grammar compiled by `grammars`, the engine's), or None where it has
    none (no penalty, no log-probabilities, no grammar)."""
    sampling, grammar = options.sampling(), options.grammar
    if not sampling.penalized and sampling.logprobs is None and grammar is None:
        return None
    if grammar is not None and grammars is None:
        raise ConfigError(f"{grammar.origin}: this decoder has no grammar compiler (its model's tokenizer)")
    return TokenRules(sampling, prompt_ids, grammars.matcher(grammar) if grammar is not None else None)


def pick(rules: TokenRules | None, logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator | None) -> int:
    """The next token from logits [V]: through the rules where the sequence has them, else sampled as ever."""
    return rules.pick(logits, gen) if rules is not None else sample(logits, sampling, gen)
